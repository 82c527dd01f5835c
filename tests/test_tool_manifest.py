"""Tool servers in a module ([tool.NAME], docs/modules.md): the gate checks one as it checks a
process, composition refuses two of one name (and one named like another module's process),
naming both modules, and a declaration stays canonical: a machine without tool servers keeps
the bytes it had before they existed, `${machine}` is substituted, and the diff names them."""

import pytest
from module_folders import module_version

from mesh.modules.compose import Conflict, canonical, compose, digest, encode, merge, prepare
from mesh.modules.diff import diff
from mesh.modules.gate import Refused, parse

BUNDLE = '[bundle.files]\nkind = "files"\nsource = "src"\n[account.files]\n'


def tool(extra: str = "", *, name: str = "files", account: str = 'account = "files"') -> str:
    return (
        f'[tool.{name}]\nbundle = "files"\ncommand = ["python3", "files_server.py"]\n'
        f"{account}\n{extra}"
    )


def refused(body: str) -> str:
    with pytest.raises(Refused) as e:
        parse('[module]\nname = "m"\n' + body)
    return str(e.value)


def test_a_tool_server_is_read_with_its_defaults() -> None:
    m = parse('[module]\nname = "m"\n' + BUNDLE + tool('env = { A = "1" }\n'))
    t = m.tool["files"]
    assert t.command == ["python3", "files_server.py"] and t.account == "files"
    assert (t.timeout, t.stop_timeout, t.env, t.files, t.root) == ("30s", "10s", {"A": "1"}, {},
                                                                    False)  # fmt: skip


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            BUNDLE + tool(account=""),
            "tool.files.account: tool servers never run as root unless said",
        ),
        (BUNDLE + tool("root = true\n"), "tool.files.root: name an account or set root = true"),
        (
            BUNDLE + tool().replace('bundle = "files"', 'bundle = "app"'),
            "tool.files.bundle: unknown bundle 'app' (known: files)",
        ),
        (
            BUNDLE + tool().replace('bundle = "files"\n', ""),
            "tool.files.bundle: a tool server runs from a bundle",
        ),
        (BUNDLE + tool(account='account = "www"'), "tool.files.account: unknown account 'www'"),
        (
            BUNDLE + tool().replace('["python3", "files_server.py"]', '"python3 files_server.py"'),
            "tool.files.command: 'python3 files_server.py' is a shell string",
        ),
        (
            BUNDLE + tool().replace('["python3", "files_server.py"]', '["sh", "-c", "x"]'),
            "tool.files.command: ['sh', '-c', 'x'] runs a shell string",
        ),
        (
            BUNDLE + tool('files = { "../x" = { text = "a" } }\n'),
            "tool.files.files.../x: '../x' escapes the module",
        ),
        (
            BUNDLE + tool('files = { "t" = { secret = "s", mode = "0440" } }\n'),
            "tool.files.files.t.mode: '0440' lets others read a secret",
        ),
        (BUNDLE + tool('env = { "A-B" = "1" }\n'), "tool.files.env: 'A-B' is not a valid"),
        (BUNDLE + tool('colour = "red"\n'), "tool.files.colour: unknown field"),
        (BUNDLE + tool('timeout = "30"\n'), "tool.files.timeout: '30' is not a duration"),
        (BUNDLE + tool('timeout = "0s"\n'), "tool.files.timeout: '0s': a call's limit is more"),
        (BUNDLE + tool('timeout = "2h"\n'), "at most 60m"),
        (BUNDLE + tool(name='"a.b"'), "tool.a.b: 'a.b' is not a valid name"),
        (
            BUNDLE + tool() + '[process.files]\nbundle = "files"\ncommand = ["x"]\n'
            'account = "files"\n',
            "tool.files: process files has this name too",
        ),
    ],
)
def test_the_gate_checks_a_tool_server_as_a_process(body: str, expected: str) -> None:
    line = refused(body)
    assert line.startswith("module m: ") and expected in line, line


def test_too_many_tool_servers_are_refused() -> None:
    body = BUNDLE + "".join(tool(name=f"t{i}") for i in range(65))
    assert "tool: 65 tool servers, at most 64" in refused(body)


FILES = BUNDLE + tool('files = { "notes.txt" = { text = "on ${machine}" } }\n').replace(
    '"files_server.py"]', '"files_server.py", "--machine", "${machine}"]'
)


def test_composition_refuses_two_tool_servers_of_one_name_naming_both_modules() -> None:
    with pytest.raises(
        Conflict, match=r"tool server files is declared by modules a and b \(on n1\)"
    ):
        compose("n1", [module_version("b", FILES), module_version("a", FILES)])


def test_a_tool_server_named_like_another_modules_process_is_a_conflict() -> None:
    proc = BUNDLE + '[process.files]\nbundle = "files"\ncommand = ["x"]\naccount = "files"\n'
    for mods in (
        [module_version("a", FILES), module_version("b", proc)],
        [module_version("a", proc), module_version("b", FILES)],
    ):
        with pytest.raises(Conflict, match="files of module a and .* files of module b would "
                           r"share a folder and a log \(on n1\)"):  # fmt: skip
            compose("n1", mods)


def test_a_declaration_with_tool_servers_is_canonical() -> None:
    one = compose("node-2", [module_version("files", FILES), module_version("other", "")])
    two = compose("node-2", [module_version("other", ""), module_version("files", FILES)])
    assert canonical(one) == canonical(two) and digest(one) == digest(two)
    merged = merge("node-2", [prepare(module_version("files", FILES))])
    assert encode(merged)[0] == canonical(compose("node-2", [module_version("files", FILES)]))
    t = one.tools["files"]
    assert t.command[-1] == "node-2" and t.files["notes.txt"].text == "on node-2"
    assert t.bundle in one.bundles and t.module == "files"
    other = compose("node-3", [module_version("files", FILES)])
    assert other.tools["files"].command[-1] == "node-3" and digest(other) != digest(one)


def test_a_declaration_without_tool_servers_has_the_bytes_it_had_before_them() -> None:
    body = canonical(compose("n1", [module_version("m", "")]))
    assert b"tools" not in body
    assert body == (
        b'{"accounts":{},"bundles":{},"containers":{},"machine":"n1",'
        b'"modules":{"m":"sha256:v-m"},"processes":{}}'
    )
    assert encode(merge("n1", [prepare(module_version("m", ""))]))[0] == body


def test_the_diff_names_tool_servers() -> None:
    before = compose("n1", [module_version("files", FILES)])
    after = compose("n1", [module_version("files", FILES.replace('"on ${machine}"', '"changed"'))])
    changes = diff(before, after)
    assert [(c.op, c.kind, c.name) for c in changes] == [("~", "tool", "files")]
    assert list(changes[0].fields) == ["files"]
    gone = diff(before, compose("n1", [module_version("m", "")]))
    assert ("-", "tool", "files") in [(c.op, c.kind, c.name) for c in gone]
