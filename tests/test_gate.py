"""The registration gate: one test per rule, each refusal naming module, field and value."""

import textwrap
from pathlib import Path

import pytest

from mesh.modules.gate import Refused, duration, parse

GOOD = """
[module]
name = "hello"

[bundle.hello]
kind = "files"
source = "src"

[account.hello]
home = "/var/lib/hello"

[process.hello]
bundle = "hello"
command = ["python3", "hello.py"]
account = "hello"
files = { "token" = { secret = "hello-token", mode = "0400" }, "app.conf" = { text = "x" } }
check = { tcp = 8080, every = "2s", passes = 2 }
"""


def refused(toml: str) -> str:
    with pytest.raises(Refused) as e:
        parse(textwrap.dedent(toml))
    return str(e.value)


def test_a_good_manifest_passes() -> None:
    m = parse(GOOD)
    assert m.module.name == "hello"
    assert m.process["hello"].command == ["python3", "hello.py"]


def test_container_built_from_own_source_is_refused() -> None:
    line = refused(GOOD + '[container.cache]\nbuild = "."\n')
    assert line.startswith("module hello: container.cache.build:")
    assert "never an image" in line


def test_container_with_a_local_path_image_is_refused() -> None:
    assert "container.cache.image" in refused(GOOD + '[container.cache]\nimage = "./img"\n')


def test_unknown_bundle_is_refused() -> None:
    line = refused(GOOD.replace('bundle = "hello"', 'bundle = "nope"'))
    assert "process.hello.bundle" in line and "'nope'" in line


def test_unknown_account_is_refused() -> None:
    line = refused(GOOD.replace('account = "hello"', 'account = "ghost"'))
    assert "process.hello.account" in line and "'ghost'" in line


def test_a_process_without_account_is_refused_unless_root() -> None:
    line = refused(GOOD.replace('account = "hello"\n', ""))
    assert "process.hello.account" in line and "root" in line


@pytest.mark.parametrize("path", ["../up", "/etc", "a/../../b"])
def test_bundle_source_escaping_is_refused(path: str) -> None:
    line = refused(GOOD.replace('source = "src"', f'source = "{path}"'))
    assert "bundle.hello.source" in line and "escapes" in line


@pytest.mark.parametrize("path", ["../token", "/etc/passwd"])
def test_file_path_escaping_is_refused(path: str) -> None:
    line = refused(GOOD.replace('"app.conf" = { text', f'"{path}" = {{ text'))
    assert f"process.hello.files.{path}" in line and "escapes" in line


def test_shell_string_command_is_refused_with_the_argv_it_should_be() -> None:
    line = refused(
        GOOD.replace('command = ["python3", "hello.py"]', 'command = "python3 hello.py"')
    )
    assert "process.hello.command" in line
    assert "shell string" in line and '["python3","hello.py"]' in line


def test_sh_dash_c_is_a_shell_string_too() -> None:
    line = refused(GOOD.replace('["python3", "hello.py"]', '["sh", "-c", "python3 hello.py"]'))
    assert "process.hello.command" in line and "-c" in line


def test_shell_string_prepare_and_build_are_refused() -> None:
    assert "process.hello.prepare" in refused(GOOD + 'prepare = "make migrate"\n')
    built = GOOD.replace('source = "src"', 'source = "src"\nbuild = "make"\noutput = "out"')
    assert "bundle.hello.build" in refused(built)


def test_a_word_not_in_its_list_is_refused_with_the_list() -> None:
    said = refused("""\
        [module]
        name = "x"
        [process.a]
        command = ["x"]
        root = true
        restart = "on-falure"
    """)
    assert said == (
        "module x: process.a.restart: Invalid enum value 'on-falure': one of 'always', "
        "'on-failure', 'never'"
    )
    said = refused('[module]\nname = "x"\n[rollout]\ndeadline = "1s"\ncrash_loop = 0\n')
    assert said == "module x: rollout.crash_loop: Expected `int` >= 1"


def test_unknown_fields_are_refused_by_name() -> None:
    assert refused(GOOD + 'colour = "red"\n').endswith("process.hello.colour: unknown field")
    assert "module.owner: unknown field" in refused(
        GOOD.replace('name = "hello"', 'name = "hello"\nowner = "me"')
    )


@pytest.mark.parametrize("value", ["2 seconds", "fast", "-1s", "2"])
def test_durations_that_do_not_parse_are_refused(value: str) -> None:
    line = refused(GOOD.replace('every = "2s"', f'every = "{value}"'))
    assert "process.hello.check.every" in line and repr(value) in line


@pytest.mark.parametrize("value", ["rw", "0999", "400000"])
def test_modes_that_do_not_parse_are_refused(value: str) -> None:
    line = refused(GOOD.replace('mode = "0400"', f'mode = "{value}"'))
    assert "process.hello.files.token.mode" in line and repr(value) in line


def test_a_secret_readable_by_others_is_refused() -> None:
    line = refused(GOOD.replace('mode = "0400"', 'mode = "0644"'))
    assert "process.hello.files.token.mode" in line and "secret" in line


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('name = "hello"', 'name = "hel.lo"', "module.name"),
        ("[process.hello]", '[process."a*b"]', "process.a*b"),
        ("[bundle.hello]", '[bundle."x y"]', "bundle.x y"),
        ('secret = "hello-token"', 'secret = "hello.token"', "process.hello.files.token.secret"),
    ],
)
def test_names_that_are_not_subject_tokens_are_refused(old: str, new: str, field: str) -> None:
    line = refused(GOOD.replace(old, new))
    assert f": {field}:" in line


def test_two_checks_on_one_port_in_one_module_are_refused() -> None:
    second = '[process.other]\nbundle = "hello"\ncommand = ["x"]\naccount = "hello"\n'
    line = refused(GOOD + second + "check = { tcp = 8080 }\n")
    assert "process.other.check.tcp" in line and "8080" in line


def test_declared_ports_are_ports_and_each_one_processs() -> None:
    second = '[process.other]\nbundle = "hello"\ncommand = ["x"]\naccount = "hello"\n'
    assert "is used by process hello too" in refused(GOOD + second + "ports = [8080]\n")
    line = refused(GOOD + second + "ports = [0]\n")
    assert "process.other.ports: 0 is not a port (1-65535)" in line, line
    assert "process.other.ports" in refused(GOOD + second + 'ports = ["http"]\n')
    parse(GOOD.replace("passes = 2 }", "passes = 2 }\nports = [8080, 9090]"))  # its own


def test_wrong_types_name_the_field() -> None:
    assert "process.hello.check.passes" in refused(GOOD.replace("passes = 2", 'passes = "two"'))


def test_duration_parses() -> None:
    assert duration("500ms") == 0.5
    assert duration("1m") == 60


@pytest.mark.parametrize(
    "argv",
    [
        '["/usr/bin/env", "sh", "-c", "x"]',
        '["bash", "-lc", "x"]',
        '["sh", "-ec", "x"]',
        '["/bin/dash", "-c", "x"]',
        '["bash", "-o", "pipefail", "-c", "x"]',
        '["sh", "+e", "-c", "x"]',
        '["env", "-S", "sh -c id"]',
        '["busybox", "sh", "-c", "x"]',
    ],
)
def test_shells_given_a_command_string_are_refused(argv: str) -> None:
    line = refused(GOOD.replace('["python3", "hello.py"]', argv))
    assert "process.hello.command" in line and "shell string" in line


@pytest.mark.parametrize(
    "argv",
    ['["sh", "build.sh"]', '["bash", "-e", "build.sh"]', '["bash", "-o", "pipefail", "b.sh"]'],
)
def test_a_shell_running_a_script_file_is_argv(argv: str) -> None:
    assert parse(GOOD.replace('["python3", "hello.py"]', argv)).process["hello"].command[0]


def test_every_module_in_the_repository_passes_the_gate() -> None:
    root = Path(__file__).parent.parent
    found = sorted(root.glob("services/*/module.toml")) + sorted(
        root.glob("docs/examples/*/module.toml")
    )
    assert len(found) >= 4
    for path in found:
        assert parse(path.read_text(), origin=str(path)).module.name


def test_replaces_without_a_check_is_refused() -> None:
    # Without a check the process is healthy as soon as it starts, so its container would be
    # removed before the process has shown it can take over.
    line = refused(
        GOOD.replace('check = { tcp = 8080, every = "2s", passes = 2 }\n', "")
        + 'replaces = "old-hello"\n'
    )
    assert line.startswith("module hello: process.hello.replaces:")
    assert "'old-hello'" in line and "check" in line
    assert "\n" not in line
    with_check = parse(GOOD + 'replaces = "old-hello"\n')
    assert with_check.process["hello"].replaces == "old-hello"


AGENT = """
[module]
name = "agent"
[bundle.mesh]
kind = "mesh"
[process.mesh-host]
bundle = "mesh"
command = ["./mesh", "host", "run"]
root = true
"""


def test_the_host_agent_s_own_module_passes() -> None:
    assert parse(AGENT).process["mesh-host"].command == ["./mesh", "host", "run"]


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        (('command = ["./mesh", "host", "run"]', 'command = ["./mesh", "host", "run", "--x"]'),
         "process.mesh-host.command", "adds the arguments it was started with"),
        (("root = true", 'root = false\naccount = "a"\n[account.a]'),
         "process.mesh-host.root", "runs as root"),
        (('kind = "mesh"', 'kind = "files"\nsource = "."'),
         "process.mesh-host.bundle", "from a mesh bundle"),
        (("root = true", 'root = true\nenv = { A = "b" }'),
         "process.mesh-host.env", "takes no env"),
        (('kind = "mesh"', 'kind = "mesh"\nsource = "src"'), "bundle.mesh", "the mesh's own code"),
    ],
)  # fmt: skip
def test_the_host_agent_and_mesh_bundles_are_checked(
    change: tuple[str, str], field: str, says: str
) -> None:
    line = refused(AGENT.replace(*change))
    assert line.startswith(f"module agent: {field}:"), line
    assert says in line, line


def test_a_mesh_bundle_outside_the_mesh_s_source_is_refused_at_push(tmp_path: Path) -> None:
    from mesh.modules.load import load

    (tmp_path / "module.toml").write_text(AGENT)
    with pytest.raises(Refused) as e:
        load(tmp_path)
    assert str(e.value).startswith("module agent: bundle.mesh.kind:")
    assert "not inside the mesh's source" in str(e.value)


def test_a_module_inside_the_mesh_s_source_carries_the_mesh_s_code() -> None:
    from mesh.modules import archive
    from mesh.modules.load import load

    root = Path(__file__).parent.parent
    entries = archive.members(load(root / "services" / "host").source)
    assert "module.toml" in entries
    for name in ("mesh/version.py", "services/host/successor.py", "programs/cli/main.py"):
        assert f"mesh-source/{name}" in entries
    assert not any("__pycache__" in name for name in entries)


# --- [rollout] canary, soak, pause_after (docs/modules.md; steering a change) -------------------


def test_canary_soak_and_pause_after_pass_when_they_make_sense() -> None:
    for canary in ("1", "3", '"10%"', '"12.5%"', '"100%"'):
        m = parse(GOOD + f'[rollout]\ncanary = {canary}\nsoak = "2m"\npause_after = [0, 9]\n')
        assert m.rollout.soak == "2m" and m.rollout.pause_after == [0, 9]
    assert parse(GOOD).rollout.canary is None  # none unless said


@pytest.mark.parametrize(
    ("line", "field", "why"),
    [
        ('canary = "150%"', "rollout.canary", "'150%' is out of range"),
        ('canary = "0%"', "rollout.canary", "'0%' is out of range"),
        ("canary = 0", "rollout.canary", "0 is out of range (1 to 10000"),
        ("canary = -2", "rollout.canary", "-2 is out of range"),
        ('canary = "some"', "rollout.canary", "'some' is not a number of machines"),
        ("canary = true", "rollout.canary", "got `bool`"),
        ('soak = "-5s"', "rollout.soak", "'-5s' is not a duration"),
        ('soak = "2w"', "rollout.soak", "'2w' is not a duration"),
        ("pause_after = [10]", "rollout.pause_after", "10 is not a tier (0 to 9)"),
        ("pause_after = [-1]", "rollout.pause_after", "-1 is not a tier"),
    ],
)
def test_nonsense_in_canary_soak_or_pause_after_is_refused_naming_the_field(
    line: str, field: str, why: str
) -> None:
    said = refused(GOOD + f"[rollout]\n{line}\n")
    assert said.startswith(f"module hello: {field}"), said
    assert why in said, said
