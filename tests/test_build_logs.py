"""Build logs are bounded: a build that prints more than the builder keeps has its log cut to
its last 256 KiB, saying how much was cut, and a failed build's last lines stay short."""

import re

import asyncpg
from helpers import ok
from module_folders import built_module

from services.host.builder import LOG_KEEP, TAIL_BYTES

LINES = 60000  # "line 000001\n" … "line 060000\n": 720,000 bytes, far more than LOG_KEEP
CHATTY = (
    "set -e\n"
    f"seq -f 'line %06g' 1 {LINES}\n"
    "echo the last line\n"
    "mkdir -p out\nprintf '#!/bin/sh\\necho hi\\n' > out/app\n"
)
# one line of 200,000 bytes, then a failure: what the push reports must not carry it whole
LONG_LINE_FAILS = "head -c 200000 /dev/zero | tr '\\0' y\necho\necho giving up\nexit 3\n"


async def _tails(database_url: str) -> list[str]:
    conn = await asyncpg.connect(database_url)
    try:
        return [r["log_tail"] for r in await conn.fetch("SELECT log_tail FROM builds")]
    finally:
        await conn.close()


async def test_a_long_build_log_keeps_its_tail_and_says_what_was_cut(
    start_fleet, cli, tmp_path, database_url
) -> None:
    await start_fleet(hosts=1, builder=True)
    ok(cli("push", str(built_module(tmp_path / "m", CHATTY))))
    printed = "".join(f"line {i:06d}\n" for i in range(1, LINES + 1)) + "the last line\n"

    shown = ok(cli("build", "logs", "built"))
    first, rest = shown.split("\n", 1)
    cut = re.fullmatch(r"\[… (\d+) bytes cut …\]", first)
    assert cut, first
    assert int(cut[1]) + len(rest.encode()) == len(printed.encode())  # nothing lost but the cut
    assert len(rest.encode()) <= LOG_KEEP
    assert printed.endswith(rest)  # the tail, exactly
    assert re.fullmatch(r"line \d{6}", rest.split("\n", 1)[0])  # starting at a whole line
    assert rest.endswith("line 060000\nthe last line\n")

    built_module(tmp_path / "m", LONG_LINE_FAILS)
    failed = cli("push", str(tmp_path / "m"))
    assert failed.returncode == 1
    assert "exit code 3" in failed.stderr and "giving up" in failed.stderr
    assert len(failed.stderr.encode()) < TAIL_BYTES + 1024  # not the 200,000-byte line
    assert all(len(t.encode()) <= TAIL_BYTES for t in await _tails(database_url))
    shown = ok(cli("build", "logs", "built"))
    assert shown.endswith("giving up\n") and len(shown.encode()) <= LOG_KEEP + 64
