"""A process's output log, rotated by size while the process runs.

A supervised process writes into a pipe; this small program (one per running instance, in its
own session, started by the host as `python3 -I -S logwriter.py FILE MAX_BYTES KEEP`) reads the
pipe and appends to FILE (`output.log`). A file never grows past MAX_BYTES: before it would, it
becomes `output.log.1` (`.1` becomes `.2`, …, `.KEEP` is dropped), cut after a whole line when
one fits. It is its own process, not the host, because processes outlive their host (a new host
adopts them): a pipe whose reader is the host would break them the moment the host stops. It
exits when the last writer of the pipe is gone (the process and whatever it started).

Offsets are counted over the whole output, not per file: `FILE.base` holds how many bytes came
before FILE's first byte, so `mesh logs -f` reads on across rotations (`read`).

Each line is written with the time it was read from the pipe in front of it, in UTC to the
millisecond (`2026-12-07T19:40:01.123Z `: STAMP_BYTES), so `mesh logs` shows when, `--since`
finds where a time starts (`since`), and the host's markers (a start, a restart and why) fall
in order among the lines.

Only the standard library: it runs isolated (`-I -S`), importing nothing of the mesh's.
"""

import fcntl
import os
import sys
import time
from pathlib import Path

CHUNK = 64 * 1024
STAMP_BYTES = len("2026-12-07T19:40:01.123Z ")
BACK = 64 * 1024  # bytes read at a time when looking back for lines


def stamp(at: float) -> bytes:
    """The time in front of a line."""
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at))
    return f"{whole}.{int(at * 1000) % 1000:03d}Z ".encode()


def stamped(chunk: bytes, *, at_start: bool, now: bytes) -> tuple[bytes, bool]:
    """`chunk` with `now` in front of each line that starts in it (the first too if the last
    chunk ended a line); and whether it ends one."""
    parts = chunk.split(b"\n")
    out = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if last and not part:
            break  # the chunk ended with its line
        if i > 0 or at_start:
            out.append(now)
        out.append(part if last else part + b"\n")
    return b"".join(out), chunk.endswith(b"\n")


def _write_all(fd: int, data: bytes) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def _rotated(log_file: Path, n: int) -> Path:
    return log_file.with_name(f"{log_file.name}.{n}")


def _base_file(log_file: Path) -> Path:
    return log_file.with_name(f"{log_file.name}.base")


def _base(log_file: Path) -> int:
    """Bytes of output before `log_file`'s first byte. Without a record (logs rotated by an
    older host, which kept none), the rotated files' sizes: the oldest kept byte is 0."""
    try:
        return int(_base_file(log_file).read_text())
    except (OSError, ValueError):
        pass
    total = 0
    for n in range(1, 100):
        try:
            total += _rotated(log_file, n).stat().st_size
        except OSError:
            break
    return total


def _segments(log_file: Path) -> list[tuple[int, Path, int]]:
    """(first offset, path, size) of each file, oldest first; the current file last."""
    base = _base(log_file)
    try:
        size = log_file.stat().st_size
    except FileNotFoundError:
        size = 0
    found = [(base, log_file, size)]
    for n in range(1, 100):
        try:
            older = _rotated(log_file, n).stat().st_size
        except OSError:
            break
        base -= older
        found.insert(0, (base, _rotated(log_file, n), older))
    return found


def read(log_file: Path, offset: int | None, most: int) -> tuple[int, bytes]:
    """Up to `most` bytes of output from `offset` (None: the last `most` bytes), across the
    rotated files; and the offset after them. An offset whose bytes were rotated away reads
    from the oldest byte kept; one past the end reads nothing."""
    for _ in range(3):  # a rotation in the middle of the read: read again
        before = _base(log_file)
        segments = _segments(log_file)
        first = segments[0][0]
        end = segments[-1][0] + segments[-1][2]
        start = max(first, end - most) if offset is None else min(max(offset, first), end)
        data = b""
        for at, path, size in segments:
            here = start + len(data)
            last = path == log_file
            if len(data) >= most or (not last and at + size <= here):
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(max(0, here - at))
                    left = most - len(data)
                    data += f.read(left if last else min(left, at + size - here))
            except FileNotFoundError:
                break
        if _base(log_file) == before:
            return start + len(data), data
    return start + len(data), data


def end(log_file: Path) -> int:
    """The offset after the last byte of output."""
    segments = _segments(log_file)
    return segments[-1][0] + segments[-1][2]


def tail_offset(log_file: Path, lines: int) -> int:
    """Where the last `lines` lines start (the oldest byte kept, if there are fewer)."""
    last = end(log_file)
    first = _segments(log_file)[0][0]
    at, found = last, 0
    while at > first:
        start = max(first, at - BACK)
        _, data = read(log_file, start, at - start)
        # A final line without its newline yet counts as a line too.
        newlines = [i for i, b in enumerate(data) if b == 10 and start + i + 1 < last]
        for i in reversed(newlines):
            found += 1
            if found == lines:
                return start + i + 1
        at = start
    return first


def since(log_file: Path, at: str) -> int:
    """Where the first line stamped `at` (as `stamp` writes it) or later starts; the end if
    none is. Lines are in time order, so the search halves the output each look."""
    segments = _segments(log_file)
    low, high = segments[0][0], end(log_file)
    key = at.encode()
    while low < high:  # the first line start at or after `mid` whose stamp is before `at`?
        mid = (low + high) // 2
        start, stamp_ = _line_at(log_file, mid, high)
        if start is None or stamp_ >= key:
            high = mid
        else:
            low = start + 1
    start, _ = _line_at(log_file, low, end(log_file))
    return start if start is not None else end(log_file)


def _line_at(log_file: Path, offset: int, end: int) -> tuple[int | None, bytes]:
    """The first line that starts at or after `offset` (before `end`), and its stamp."""
    got, data = read(log_file, max(offset - 1, 0), BACK)
    began = got - len(data)
    if began >= offset:  # from the oldest byte kept: a file starts with a whole line
        start = began
    else:
        skip = data.find(b"\n")
        if skip < 0:
            return None, b""
        start = began + skip + 1
    if start >= end:
        return None, b""
    _, head = read(log_file, start, STAMP_BYTES)
    return start, head


LAST_LINE_MOST = 200  # characters of a process's last line a report carries


def last_line(log_file: Path) -> str:
    """The last line the process printed (the host's own `[mesh]` lines and the time in front
    left out), at most LAST_LINE_MOST characters; "" if none."""
    _, data = read(log_file, None, 8192)
    for line in reversed(data.decode(errors="replace").splitlines()):
        text = line[STAMP_BYTES:] if len(line) >= STAMP_BYTES and line[10:11] == "T" else line
        if text.strip() and not text.startswith("[mesh] "):
            return text.strip()[:LAST_LINE_MOST]
    return ""


class Writer:
    """Appends to `log_file`, rotating it at `limit` bytes, keeping `keep` older files."""

    def __init__(self, log_file: Path, *, limit: int, keep: int) -> None:
        self.log_file, self.limit, self.keep = log_file, max(1, limit), max(1, keep)
        self.fd = -1
        try:
            self.fd = self._open()
        except OSError:
            pass  # tried again at each write: the pipe stays read whatever happens

    def _open(self) -> int:
        return os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def _current(self) -> bool:
        """Our file is still `log_file` (another writer of the same process, as in a
        start-first swap, may have rotated it)."""
        try:
            return os.stat(self.log_file).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def _rotate(self) -> None:
        folder = os.open(self.log_file.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)  # one rotation at a time, whoever writes
            if self.fd >= 0 and self._current():
                size = os.fstat(self.fd).st_size
                base = _base(self.log_file) + size
                for n in range(self.keep - 1, 0, -1):
                    try:
                        os.replace(_rotated(self.log_file, n), _rotated(self.log_file, n + 1))
                    except FileNotFoundError:
                        pass
                os.replace(self.log_file, _rotated(self.log_file, 1))
                record = self.log_file.with_name(f"{self.log_file.name}.base.tmp")
                record.write_text(str(base))
                os.replace(record, _base_file(self.log_file))
            self.reopen()
        finally:
            os.close(folder)  # and the lock with it

    def reopen(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1  # should opening fail, the next write tries again
        self.fd = self._open()

    def write(self, chunk: bytes) -> None:
        if self.fd < 0 or not self._current():
            self.reopen()
        while chunk:
            room = self.limit - os.fstat(self.fd).st_size
            if len(chunk) < room:
                _write_all(self.fd, chunk)
                return
            # Fill the file up to a whole line; a line longer than a whole file is split.
            newline = chunk.rfind(b"\n", 0, max(room, 0))
            if newline >= 0:
                cut = newline + 1
            elif room == self.limit:
                cut = room
            else:
                cut = 0
            _write_all(self.fd, chunk[:cut])
            chunk = chunk[cut:]
            self._rotate()


def main(argv: list[str]) -> int:
    log_file, limit, keep = Path(argv[1]), int(argv[2]), int(argv[3])
    writer = Writer(log_file, limit=limit, keep=keep)
    at_start = True
    while True:
        chunk = os.read(0, CHUNK)
        if not chunk:
            return 0
        chunk, at_start = stamped(chunk, at_start=at_start, now=stamp(time.time()))
        try:
            writer.write(chunk)
        except OSError:
            # A full disk loses output, never the process: it must not find its pipe closed.
            try:
                writer.reopen()
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv))
