"""Placement that follows labels: `mesh assign MODULE --label K=V` is a standing selector. A
machine labelled so later, or registering with the label, gets the module through a plan; a
label removed takes it off; `mesh unassign MODULE --label K=V` drops the selector. Against a
real controller, hosts, NATS and PostgreSQL."""

from helpers import already, await_until, ok, ok_json
from module_folders import gated_module


async def test_a_module_assigned_by_label_follows_the_labels(
    start_fleet, start_host, nc, cli, tmp_path
) -> None:
    await start_fleet(hosts=2)
    for name in ("batchy", "marker"):  # healthy at once, assigned nowhere at first
        ok(cli("push", str(gated_module(tmp_path / name, name=name, tiers="[]"))))

    def assigned() -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for m in ok_json(cli("modules", "--json"))["modules"]:
            found.setdefault(m["name"], set()).update(m["assigned"])
        return found

    async def placed(module: str, machines: set[str]) -> None:
        def there():
            return assigned().get(module, set()) == machines

        await await_until(lambda: already(there()), within=60, what=f"{module} on {machines}")

    said = ok_json(cli("assign", "batchy", "--label", "role=batch", "--json"))
    assert said["plan"] is None, said
    assert (
        "no machine matches role=batch now: batchy goes to each machine labelled so"
        in (said["message"])
    )

    # Labelled later: it gets the module through a plan of its own, asked as the selector's
    # operator.
    ok(cli("label", "node-2", "role=batch"))
    await placed("batchy", {"node-2"})
    plan = ok_json(cli("plan", "--json"))["plans"][0]
    assert (plan["trigger"], plan["subject"], plan["by"]) == ("assign", "batchy", "anonymous")

    # A machine that registers with the label gets it too.
    start_host("node-3", "--tier", "2", "--label", "role=batch")
    await placed("batchy", {"node-2", "node-3"})

    # A label removed takes it off.
    ok(cli("label", "node-2", "--remove", "role"))
    await placed("batchy", {"node-3"})

    # Unassigned by the label: off every machine matching it, and no longer followed. Machines
    # are placed in the order they are labelled: once node-1 has `marker` (labelled after it
    # was labelled role=batch), its role=batch has been looked at, and brought nothing.
    gone = ok_json(cli("unassign", "batchy", "--label", "role=batch", "--wait", "--json"))
    assert "it no longer follows those labels" in gone["message"], gone
    await placed("batchy", set())
    ok(cli("assign", "marker", "--label", "tag=x"))
    ok(cli("label", "node-1", "role=batch"))
    ok(cli("label", "node-1", "tag=x"))
    await placed("marker", {"node-1"})
    assert assigned().get("batchy", set()) == set()
