"""The nemesis (issue 29): a seeded random schedule of faults on the network-namespace cluster
(3 nats-servers, PostgreSQL primary + synchronous standby, 2 controllers, 3 hosts) while a
client works, then a checker over the history. Root only (network namespaces).

    sudo .venv/bin/python bench/nemesis.py --seed 1 --minutes 2

Prints the faults as they start, then the figures: status requests answered within the
command line's timeout, those unanswered by the faults active then, those during documented
faults, and every violation with the seed, the schedule and the history around it. Exit code 1
on any violation. The run's history and logs stay in --dir (a temporary folder by default).

The harness is tests/nemesis/ (the suite's tests/test_nemesis.py runs it too, shorter): this
script is its command line, not a second copy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import netns
from common import BenchError, machine_line, run_or_exit, say
from nemesis.cluster import ClusterError
from nemesis.run import describe, run


async def main(args: argparse.Namespace) -> int:
    why = netns.unavailable()
    if why:
        raise BenchError(why)
    folder = args.dir or Path(tempfile.mkdtemp(prefix=f"nemesis-{args.seed}-"))
    say(machine_line())
    say(f"nemesis: seed {args.seed}, {args.minutes:g} minutes; history in {folder}/history.jsonl")
    try:
        outcome = await run(args.seed, args.minutes, folder, say=say,
                            under_repair=tuple(args.under_repair))  # fmt: skip
    except ClusterError as e:
        raise BenchError(f"{e} (the logs: {folder}/*.log)") from None
    say()
    for line in describe(outcome):
        say(line)
    say(machine_line())
    return 0 if outcome.report.ok else 1


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, required=True, help="the schedule's seed")
    p.add_argument("--minutes", type=float, default=2.0, help="how long the faults go on (2)")
    p.add_argument("--dir", type=Path, default=None, help="the history and logs (a new folder)")
    p.add_argument(
        "--under-repair", action="append", default=[], metavar="KIND/ROLE",
        help="count status lost during this fault apart, not as a violation (say "
        "block-nats/holder); only as the lead decides: by default every loss counts",
    )  # fmt: skip
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(run_or_exit(main(parse())))
