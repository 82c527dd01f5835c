"""Input limits (docs/modules.md and docs/verbs.md, Limits), and regressions of what fuzzing
found (tests/test_fuzz.py): each refusal is the documented error, naming the field and value."""

import io
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
from helpers import MESH, ask, await_until, mesh_cli

from mesh import blobs, subjects
from mesh.modules import archive, gate, load

GOOD = (Path(__file__).parent.parent / "docs" / "examples" / "hello" / "module.toml").read_text()


def _tar(*entries: tarfile.TarInfo | tuple[str, bytes], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for entry in entries:
            if isinstance(entry, tuple):
                info = tarfile.TarInfo(entry[0])
                info.size = len(entry[1])
                tar.addfile(info, io.BytesIO(entry[1]))
            else:
                tar.addfile(entry)
    return out.getvalue()


def _entry(name: str, kind: bytes, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


def refused(data: bytes) -> str:
    with pytest.raises(archive.ArchiveRefused) as e:
        archive.members(data)
    return str(e.value)


# --- archives: what a host unpacks, what push checks ---------------------------------------


def test_a_sparse_file_that_would_unpack_to_a_terabyte_is_refused() -> None:
    # A few hundred bytes that tarfile reads back as a 1 TB file full of holes: unpacking it
    # (bundle store, builder) read it whole into memory before.
    info = tarfile.TarInfo("big")
    info.size = 1
    info.pax_headers = {"GNU.sparse.size": str(10**12), "GNU.sparse.map": "0,1",
                        "GNU.sparse.numblocks": "1", "GNU.sparse.name": "big"}  # fmt: skip
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(b"x"))
    assert "big: sparse files are not accepted" in refused(out.getvalue())


def test_a_size_header_larger_than_the_archive_is_refused() -> None:
    info = tarfile.TarInfo("a")
    info.size = 1
    info.pax_headers = {"size": str(10**10)}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(b"x"))
    limit = archive.MAX_UNPACKED
    assert refused(out.getvalue()).startswith(f"a: its files unpack to more than {limit} bytes")


def test_more_entries_than_the_limit_are_refused() -> None:
    folders = [_entry(f"d{i}", tarfile.DIRTYPE) for i in range(archive.MAX_ENTRIES + 1)]
    assert refused(_tar(*folders, fmt=tarfile.USTAR_FORMAT)) == (
        f"more than {archive.MAX_ENTRIES} entries"
    )
    archive.members(_tar(*folders[:-1], fmt=tarfile.USTAR_FORMAT))  # the limit itself is fine


def test_an_archive_over_the_size_limit_is_refused_before_it_is_read() -> None:
    big = b"\0" * (archive.MAX_ARCHIVE + 1)
    assert refused(big) == f"the archive is {len(big)} bytes, at most {archive.MAX_ARCHIVE}"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "not a tar archive"),
        (b"not an archive at all", "not a tar archive"),
        (_tar(("a", b"hi"))[:700], "not a tar archive"),  # cut inside the data
        (_tar(_entry(".", tarfile.REGTYPE)), "only a folder can be the archive's root"),
        (_tar(_entry("", tarfile.SYMTYPE, "a")), "only a folder can be the archive's root"),
        (_tar(_entry("a", tarfile.SYMTYPE, "")), "a: symlink to nothing"),
        (_tar(("a", b"file"), ("a/b", b"under it")), "a/b: lies under the file a"),
        (_tar(("x" * 256, b"")), "a name longer than a file system takes"),
    ],
)
def test_malformed_archives_are_refused_not_crashed_on(data: bytes, says: str, tmp_path) -> None:
    # Each raised tarfile.ReadError, FileExistsError or NotADirectoryError before: an `internal`
    # error at push, a failed unpack at the host.
    assert says in refused(data)
    with pytest.raises(archive.ArchiveRefused):
        archive.unpack(data, tmp_path / "out")


# --- the manifest --------------------------------------------------------------------------

# table, its limit, how many the example has already, the plural, one more entry
_TABLES = [
    ("bundle", gate.MAX_BUNDLES, 1, "bundles",
     lambda i: f'[bundle.b{i}]\nkind = "files"\nsource = "src"\n'),
    ("account", gate.MAX_ACCOUNTS, 1, "accounts", lambda i: f"[account.a{i}]\n"),
    ("process", gate.MAX_PROCESSES, 1, "processes",
     lambda i: f'[process.p{i}]\nbundle = "hello"\naccount = "hello"\ncommand = ["x"]\n'),
    ("container", gate.MAX_CONTAINERS, 0, "containers",
     lambda i: f'[container.c{i}]\nimage = "docker.io/x"\n'),
    ("tool", gate.MAX_TOOLS, 0, "tool servers",
     lambda i: f'[tool.t{i}]\nbundle = "hello"\naccount = "hello"\ncommand = ["x"]\n'),
]  # fmt: skip


@pytest.mark.parametrize(("table", "limit", "has", "plural", "entry"), _TABLES,
                         ids=[t[0] for t in _TABLES])  # fmt: skip
def test_a_module_declares_at_most_so_many_of_each_table(table, limit, has, plural, entry):
    at_limit = GOOD + "".join(entry(i) for i in range(limit - has))
    assert len(getattr(gate.parse(at_limit), table)) == limit
    with pytest.raises(gate.Refused) as e:
        gate.parse(at_limit + entry(limit))
    assert str(e.value) == f"module hello: {table}: {limit + 1} {plural}, at most {limit}"


@pytest.mark.parametrize(
    ("extra", "field", "what", "limit"),
    [
        ("files", "process.hello.files", "files", gate.MAX_FILES),
        ("env", "process.hello.env", "variables", gate.MAX_ENV),
        ("command", "process.hello.command", "words", gate.MAX_ARGV),
    ],
)
def test_a_process_has_at_most_so_many_files_variables_and_words(extra, field, what, limit):
    n = limit + 1
    if extra == "files":
        body = "".join(f'"f{i}" = {{ text = "x" }}\n' for i in range(n))
        text = GOOD + body  # appended to [process.hello.files], the last table
    elif extra == "env":
        env = ", ".join(f'V{i} = "x"' for i in range(n))
        old = 'env = { PYTHONUNBUFFERED = "1", HELLO_GREETING = "hello" }'
        text = GOOD.replace(old, f"env = {{ {env} }}")
    else:
        argv = ", ".join('"x"' for _ in range(n))
        old = 'command = ["python3", "hello.py", "--port", "8080"]'
        text = GOOD.replace(old, f"command = [{argv}]")
    with pytest.raises(gate.Refused) as e:
        gate.parse(text)
    line = str(e.value)
    assert line.startswith(f"module hello: {field}: ") and f"at most {limit}" in line, line
    assert what in line


@pytest.mark.parametrize(
    ("text", "field", "says"),
    [
        # Each raised AttributeError before (an `internal` error at push): not a table.
        ('process = 1\n[module]\nname = "m"\n', "process", "Expected `object`, got `int`"),
        ('container = "x"\n[module]\nname = "m"\n', "container", "Expected `object`, got `str`"),
        ('bundle = [1]\n[module]\nname = "m"\n', "bundle", "Expected `object`, got `array`"),
        # RecursionError before.
        ("x = " + "[" * 5000 + "]" * 5000, "module.toml", "nested too deeply"),
        ("x = " + "{a = " * 3000 + "1" + "}" * 3000, "module.toml", "nested too deeply"),
        # UnicodeEncodeError before: a lone surrogate is not text.
        ('[module]\nname = "\ud800"\n', "module.toml", "not UTF-8 text"),
    ],
)
def test_manifests_that_crashed_the_gate_are_refused(text: str, field: str, says: str) -> None:
    with pytest.raises(gate.Refused) as e:
        gate.parse(text)
    assert e.value.field == field
    assert says in str(e.value)


def test_a_refusal_is_one_line_whatever_the_key() -> None:
    with pytest.raises(gate.Refused) as e:
        gate.parse('[module]\nname = "m"\n[container."a\\nb"]\ncommand = []\n')
    assert "\n" not in str(e.value)
    assert str(e.value) == "module m: container.a\\nb.command: an empty command"


def test_a_module_toml_that_is_not_utf8_or_too_large_is_refused(tmp_path: Path) -> None:
    (tmp_path / "module.toml").write_bytes(b'[module]\nname = "\xff"\n')
    with pytest.raises(gate.Refused) as e:
        load.load(tmp_path)  # UnicodeDecodeError before: a traceback from `mesh push`
    assert "not UTF-8 text: invalid start byte at byte 17" in str(e.value)
    (tmp_path / "module.toml").write_bytes(b"#" * (gate.MAX_MANIFEST + 1))
    with pytest.raises(gate.Refused, match=f"is larger than {gate.MAX_MANIFEST} bytes"):
        load.load(tmp_path)


def test_a_push_of_a_folder_that_is_not_there_says_so(tmp_path: Path) -> None:
    """`mesh push /nope` names the path and what it is not, before asking any controller."""
    (tmp_path / "file").write_text("")
    cases = ((tmp_path / "nope", "no such folder"), (tmp_path / "file", "is not a folder"))
    for path, what in cases:
        done = subprocess.run([*MESH, "push", str(path)], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode != 0
        assert done.stderr.strip() == (
            f"mesh: error: module ?: {path}: {what}: a module is a folder with a module.toml"
        ), done.stderr


# --- blobs: refused for their size before they are fetched ---------------------------------


async def test_a_blob_larger_than_the_reader_takes_is_refused_before_reading(nc) -> None:
    _, store = await blobs.ensure(nc)
    digest = await blobs.put(store, b"x" * 1000)
    assert await blobs.get(nc, digest, limit=1000) == b"x" * 1000
    with pytest.raises(blobs.BlobTooLarge, match=f"{digest} is 1000 bytes, at most 999"):
        await blobs.get(nc, digest, limit=999)


async def test_a_blob_whose_bytes_are_not_its_digest_is_refused(nc) -> None:
    """Stored under another blob's name (a substituted bundle): the object is whole by its own
    checksum, but its bytes are not the digest it is fetched by."""
    _, store = await blobs.ensure(nc)
    wanted = blobs.digest(b"the real bundle")
    await store.put(wanted.replace(":", "-"), b"something else")
    with pytest.raises(blobs.BlobCorrupt, match="the stored bytes have digest"):
        await blobs.get(nc, wanted)


# --- through a real controller -------------------------------------------------------------


async def test_a_pushed_source_that_is_not_an_archive_is_refused(nc, start_controller) -> None:
    proc = start_controller("ctl-a")
    await await_until(lambda: ask(nc, "mesh.ctl.status"), within=30, what="the controller")
    digest = await blobs.put(await blobs.store(nc), b"this is not a tar archive")
    reply = await ask(nc, subjects.ctl("push"), {"manifest": GOOD, "source": digest}, timeout=10)
    assert reply["error"]["code"] == "refused", reply  # `internal` (tarfile.ReadError) before
    assert reply["error"]["message"] == "module hello: source: not a tar archive: truncated header"
    assert (await ask(nc, subjects.ctl("status")))["seat"]["holder"] == "ctl-a"
    assert proc.poll() is None


async def test_mesh_secret_set_says_what_is_too_large(nc, start_controller, nats_url, tmp_path):
    start_controller("ctl-a")
    await await_until(lambda: ask(nc, "mesh.ctl.status"), within=30, what="the controller")
    big = tmp_path / "big"
    for size, says in [
        (600 * 1024, r"secret-set: body is \d+ bytes, at most 786432"),  # the verb's limit
        # more than nats-server takes at all: a traceback (MaxPayloadError) before
        (2 * 1024 * 1024, r"secret-set: the request is \d+ bytes, more than the NATS server"),
    ]:
        big.write_bytes(b"x" * size)
        done = mesh_cli("secret", "set", "big", "--from-file", str(big), nats_url=nats_url)
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1 and re.search(says, done.stderr), done.stderr


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('every = "2s"', 'every = "' + "9" * 400 + 's"', "process.hello.check.every"),
        ('restart = "always"', 'stop_timeout = "169h"', "process.hello.stop_timeout"),
    ],
)
def test_a_duration_is_at_most_a_week(old: str, new: str, field: str) -> None:
    # 400 nines parsed as inf, which msgspec encodes as null: a [rollout] deadline like that
    # was stored in a plan's settings that could not be read back.
    with pytest.raises(gate.Refused) as e:
        gate.parse(GOOD.replace(old, new))
    assert str(e.value).startswith(f"module hello: {field}: ")
    assert str(e.value).endswith("is longer than 168h")
    gate.parse(GOOD.replace(old, new.replace("169h", "168h").replace("9" * 400, "9")))
    assert gate.duration("168h") == gate.MAX_DURATION
