"""Composition (docs/design.md): identical duplicates merge, conflicts name both modules,
and a declaration's bytes and digest do not depend on module or field order."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from module_folders import module_version

from mesh.modules.compose import (
    Conflict,
    ModuleVersion,
    canonical,
    compose,
    digest,
    encode,
    merge,
    prepare,
)
from mesh.modules.diff import diff


def process(name: str, *, account: str = "app", port: int | None = None, extra: str = "") -> str:
    check = f"check = {{ tcp = {port} }}\n" if port else ""
    return (
        f'[bundle.{name}]\nkind = "files"\nsource = "src"\n'
        f'[process.{name}]\nbundle = "{name}"\ncommand = ["./{name}"]\naccount = "{account}"\n'
        f"{check}{extra}"
    )


ACCOUNT = '[account.app]\nhome = "/var/lib/app"\ngroups = ["a", "b"]\n'


def test_identical_accounts_from_two_modules_merge() -> None:
    a = module_version("a", ACCOUNT + process("web"))
    b = module_version("b", ACCOUNT.replace('["a", "b"]', '["b", "a"]') + process("worker"))
    decl = compose("node-1", [a, b])
    assert set(decl.accounts) == {"app"}
    assert set(decl.processes) == {"web", "worker"}
    assert decl.modules == {"a": "sha256:v-a", "b": "sha256:v-b"}


def test_same_process_name_conflicts_naming_both_modules() -> None:
    with pytest.raises(Conflict, match=r"process web is declared by modules a and b \(on node-1\)"):
        compose(
            "node-1",
            [
                module_version("a", ACCOUNT + process("web")),
                module_version("b", ACCOUNT + process("web")),
            ],
        )


def test_same_account_with_different_settings_conflicts() -> None:
    other = ACCOUNT.replace("/var/lib/app", "/srv/app")
    with pytest.raises(Conflict, match="account app is declared differently by modules a and b"):
        compose(
            "n",
            [
                module_version("a", ACCOUNT + process("x")),
                module_version("b", other + process("y")),
            ],
        )


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        ("ports = [9000, 8080]\n", "ports = [8080]\n"),  # both declared
        ("ports = [8080]\n", "check = { tcp = 8080 }\n"),  # declared, and checked
        ('check = { http = "http://127.0.0.1:8080/health" }\n', "ports = [8080]\n"),
        ('check = { http = "http://localhost/health" }\n', "ports = [80]\n"),  # its default
    ],
)
def test_a_port_two_modules_use_on_one_machine_is_refused_naming_both(
    mine: str, theirs: str
) -> None:
    a = module_version("a", ACCOUNT + process("x", extra=mine))
    b = module_version("b", ACCOUNT + process("y", extra=theirs))
    with pytest.raises(Conflict, match=r"port (8080|80) is used by process x of module a "
                       r"and process y of module b \(on node-1\)"):  # fmt: skip
        compose("node-1", [a, b])
    # Another machine's address is not this machine's port; ports are no part of the bytes.
    far = module_version(
        "a", ACCOUNT + process("x", extra='check = { http = "http://db:8080/" }\n')
    )
    compose("node-1", [far, b])
    plain = module_version("c", ACCOUNT + process("z"))
    declared = module_version("c", ACCOUNT + process("z", extra="ports = [7000]\n"))
    assert digest(compose("node-1", [plain])) == digest(compose("node-1", [declared]))


def test_two_checks_on_one_port_conflict() -> None:
    a = module_version("a", ACCOUNT + process("x", port=8080))
    b = module_version("b", ACCOUNT + process("y", port=8080))
    with pytest.raises(Conflict, match=r"port 8080 .* module a .* module b"):
        compose("n", [a, b])


def test_two_containers_of_one_name_conflict() -> None:
    c = '[container.cache]\nimage = "docker.io/library/redis:7"\n'
    with pytest.raises(Conflict, match="container cache is declared by modules a and b"):
        compose("n", [module_version("a", c), module_version("b", c)])


def test_a_secret_change_changes_the_digest_but_never_carries_the_value() -> None:
    body = ACCOUNT + process("x", extra='files = { "t" = { secret = "tok", mode = "0400" } }\n')
    before = compose("n", [module_version("a", body)], {"tok": 1})
    after = compose("n", [module_version("a", body)], {"tok": 2})
    assert digest(before) != digest(after)
    assert b"tok" in canonical(after)  # the name, so the host knows which file
    changes = diff(before, after)
    assert [(c.op, c.kind, c.name) for c in changes] == [("~", "process", "x")]


def test_diff_shows_added_changed_removed() -> None:
    old = compose("n", [module_version("a", ACCOUNT + process("x") + process("y"))])
    new = compose(
        "n",
        [module_version("a", ACCOUNT + process("x", extra='env = { A = "1" }\n') + process("z"))],
    )
    ops = {(c.op, c.kind, c.name) for c in diff(old, new)}
    assert ("~", "process", "x") in ops
    assert ("-", "process", "y") in ops
    assert ("+", "process", "z") in ops
    changed = next(c for c in diff(old, new) if c.name == "x")
    assert changed.fields["env"] == ({}, {"A": "1"}) or changed.fields["env"] == (None, {"A": "1"})


# --- determinism ----------------------------------------------------------------------------


def shuffled_module(name: str, rng: random.Random) -> ModuleVersion:
    """The same module written in a random order: tables, fields, env and files."""

    def table(header: str, lines: list[str]) -> str:
        rng.shuffle(lines)
        return f"[{header}]\n" + "\n".join(lines) + "\n"

    env = [f'{k} = "{v}"' for k, v in (("B", "2"), ("A", "1"), ("C", "3"))]
    files = [
        '"a.conf" = { text = "x" }',
        '"t" = { secret = "s", mode = "0400" }',
        '"b" = { text = "y" }',
    ]
    tables = [table("account.app", ['home = "/var/lib/app"', 'groups = ["b", "a"]'])]
    for p in ("one", "two"):
        proc = f"{name}-{p}"
        rng.shuffle(env)
        rng.shuffle(files)
        tables.append(table(f"bundle.{proc}", ['source = "src"', 'kind = "files"']))
        tables.append(
            table(
                f"process.{proc}",
                [
                    f'bundle = "{proc}"',
                    f'command = ["./{proc}", "--flag"]',
                    'account = "app"',
                    "env = { " + ", ".join(env) + " }",
                    "files = { " + ", ".join(files) + " }",
                    'restart = "on-failure"',
                    'update = "start-first"',
                    'stop_timeout = "5s"',
                ],
            )
        )
    rng.shuffle(tables)
    return module_version(name, "".join(tables))


@settings(max_examples=200, deadline=None)
@given(
    names=st.lists(
        st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True), min_size=1, max_size=6, unique=True
    ),
    seed=st.integers(0, 2**32),
)
def test_the_same_inputs_give_the_same_bytes_whatever_the_order(
    names: list[str], seed: int
) -> None:
    rng = random.Random(seed)
    first = [shuffled_module(n, rng) for n in names]
    second = [shuffled_module(n, rng) for n in names]
    rng.shuffle(second)
    one = compose("node-1", first, {"s": 1})
    two = compose("node-1", second, {"s": 1})
    assert canonical(one) == canonical(two)
    assert digest(one) == digest(two)
    # the controller's path (pieces encoded once, merged per machine) gives the same bytes
    body, d = encode(merge("node-1", [prepare(m, {"s": 1}) for m in second]))
    assert body == canonical(one) and d == digest(one)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5))
def test_different_inputs_give_different_digests(n: int) -> None:
    mods = [module_version(f"m{i}", ACCOUNT + process(f"p{i}")) for i in range(n)]
    fewer = compose("node-1", mods[:-1])
    more = compose("node-1", mods)
    assert digest(fewer) != digest(more)
    assert digest(more) != digest(compose("node-2", mods))


def test_a_check_written_with_or_without_its_defaults_gives_one_digest() -> None:
    short = module_version("a", ACCOUNT + process("x", extra="check = { tcp = 8080 }\n"))
    full = module_version(
        "a",
        ACCOUNT
        + process("x", extra='check = { tcp = 8080, every = "2s", timeout = "1s", passes = 2 }\n'),
    )
    assert digest(compose("n", [short])) == digest(compose("n", [full]))


def test_a_bundle_without_its_digest_cannot_be_composed() -> None:
    with pytest.raises(ValueError, match="without a digest"):
        compose("n", [module_version("a", ACCOUNT + process("x"), bundles={})])


def test_the_machine_s_name_is_substituted_where_a_process_says_machine() -> None:
    body = (
        '[bundle.a]\nkind = "files"\nsource = "src"\n[account.app]\n'
        '[process.a]\nbundle = "a"\ncommand = ["./a", "--name", "${machine}"]\naccount = "app"\n'
        'env = { WHO = "I am ${machine}" }\nfiles = { "f" = { text = "${machine}\\n" } }\n'
        '[process.b]\nbundle = "a"\ncommand = ["./b", "$machine"]\naccount = "app"\n'
    )
    mv = module_version("m", body)
    one, two = compose("node-1", [mv]), compose("node-2", [mv])
    assert one.processes["a"].command == ["./a", "--name", "node-1"]
    assert one.processes["a"].env == {"WHO": "I am node-1"}
    assert one.processes["a"].files["f"].text == "node-1\n"
    assert two.processes["a"].command == ["./a", "--name", "node-2"]
    assert one.processes["b"].command == ["./b", "$machine"]  # only ${machine} is a word
    # The canonical bytes are the substituted ones, whichever way they were made.
    merged = merge("node-1", [prepare(mv)])
    assert encode(merged)[0] == canonical(one)
