"""A held plan readable by its id (issue 42, item 7): `mesh plan ID --changes` shows, per
machine, what the plan would change in its declaration; an approver needs nothing but the id
(not the module's folder, as `mesh plan diff DIR` does). Real hosts, through the command line."""

from helpers import ok, ok_json
from module_folders import write_module


def _module(folder, *, command: str):
    return write_module(
        folder,
        '[module]\nname = "kept"\n[bundle.code]\nkind = "files"\nsource = "src"\n'
        f'[process.kept]\nbundle = "code"\ncommand = ["sleep", "{command}"]\nroot = true\n'
        '[assign]\nmachines = ["node-1"]\n',
        files={"src/README": "nothing to run: sleep is the system's\n"},
    )


async def test_a_held_plan_shows_what_it_changes_by_its_id(host, cli, tmp_path) -> None:
    ok(cli("push", str(_module(tmp_path / "v1", command="3600")), "--wait"))
    held = ok_json(cli("push", str(_module(tmp_path / "v2", command="7200")), "--hold", "--json"))
    plan_id = held["plan"]

    shown = ok_json(cli("plan", str(plan_id), "--changes", "--json"))
    assert shown["state"] == "held"
    [step] = shown["steps"]
    assert step["machine"] == "node-1"
    # not started: it goes from what node-1 has now (the first version's declaration)
    assert step["before"] is not None and step["before"] != step["after"]
    assert step["changes"] == [
        {"op": "~", "kind": "process", "name": "kept",
         "fields": {"command": [["sleep", "3600"], ["sleep", "7200"]]}},
    ]  # fmt: skip
    # without asking, none (a page of thousands of steps stays small)
    assert ok_json(cli("plan", str(plan_id), "--json"))["steps"][0]["changes"] is None

    text = ok(cli("plan", str(plan_id), "--changes"))
    assert "~ process kept" in text and "command: " in text, text
    assert f"mesh plan {plan_id} --changes" in ok(cli("plan", str(plan_id)))  # the way to it
