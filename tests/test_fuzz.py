"""Fuzzing (docs/design.md, issue 7): thousands of generated bodies against a real controller and
a real host (real nats-server, real PostgreSQL), and the manifest and archive loaders in-process.

For every verb in services/controller/serving/verbs.py (VERBS, HOST_VERBS) and
services/host/verbs.py: random bytes, random JSON, near-valid objects built from the verb's own
request Struct with a few fields broken, and bodies just over the verb's size limit. Every request
must be answered within a deadline, with `{"error": {"code", "message"}}` (never `internal`, never
a traceback) or with a reply that decodes as the verb's reply Struct; afterwards the process is
alive and `status` answers. In-process, `gate.parse` and `load.check_sources` may raise only
`gate.Refused`, and the archive functions only `archive.ArchiveRefused`.

Sizes are chosen for CI, about two minutes for the whole file on two cores; MESH_FUZZ_SCALE=10
runs ten times as many examples. `--hypothesis-show-statistics` shows the answers per verb.
"""

import asyncio
import io
import json
import os
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fuzzing import KNOWN_NAMES, bodies, dumps, json_values, manifests, near_valid, toml_value
from helpers import ask, await_until
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from mesh import blobs, subjects
from mesh.model import (
    Applied,
    Beat,
    NodesReply,
    ProcessesEvent,
    SeatAnnounce,
    StatusReply,
    ToolsEvent,
)
from mesh.modules import archive, compose, gate, load
from mesh.modules.compose import ModuleVersion
from mesh.modules.manifest import Manifest
from services.controller.serving import verbs as ctl_verbs
from services.host import verbs as host_verbs

MAX_PAYLOAD = 1024 * 1024  # nats-server's default max_payload: nothing larger can be sent
# Hundreds of examples against real services, CPU-bound: on a loaded machine (the suite in
# workers on two cores) a test may pass the suite's 180 s hang guard while every answer comes.
pytestmark = pytest.mark.timeout(600)
ANSWER_WITHIN = 20.0  # seconds: generous for a loaded two-core machine; never reached when well
HELLO = Path(__file__).parent.parent / "docs" / "examples" / "hello"

# Every fuzz run: no per-example deadline (real services), function-scoped fixtures on purpose
# (one controller for all the examples of a test), no database of examples left behind.
FUZZ = settings(
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.filter_too_much,
    ],
    database=None,
    print_blob=True,
)
# Against real services: no shrinking, whose many re-runs (each with its requests' deadlines)
# could outlast the test's timeout; a failure shows the whole body that caused it instead.
SERVICES = settings(FUZZ, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def _examples(n: int) -> int:
    """MESH_FUZZ_SCALE=10 runs ten times as many examples (a deeper run than CI's)."""
    return max(1, int(n * float(os.environ.get("MESH_FUZZ_SCALE", "1"))))


# NATS subject tokens: no dots, wildcards or whitespace; anything else, unicode included.
tokens = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp"),
                           blacklist_characters=".*> \t\r\n\x00"),
    min_size=1,
    max_size=80,
)  # fmt: skip
machines = st.one_of(st.sampled_from(["fuzz-1", "fuzz-2", "node-1"]), tokens)


class Case(msgspec.Struct):
    subject: str
    body: bytes
    reply: Any = Any  # the reply type when it is not an error
    label: str = ""  # what --hypothesis-show-statistics counts answers by


async def _request(nc: Client, case: Case) -> bytes | None:
    try:
        return (await nc.request(case.subject, case.body, timeout=ANSWER_WITHIN)).data
    except (NoRespondersError, NatsTimeout):
        return None


def _check(case: Case, data: bytes | None) -> None:
    what = f"{case.subject} with {case.body[:300]!r} ({len(case.body)} bytes)"
    assert data is not None, f"no answer within {ANSWER_WITHIN:g}s: {what}"
    assert b"Traceback" not in data, f"a traceback in the answer to {what}: {data[:2000]!r}"
    try:
        reply = json.loads(data)
    except ValueError:
        pytest.fail(f"the answer to {what} is not JSON: {data[:500]!r}")
    if isinstance(reply, dict) and isinstance(reply.get("error"), dict):  # not BuildReply's
        error = reply["error"]
        assert set(reply) == {"error"} and set(error) == {"code", "message"}, reply
        assert re.fullmatch(r"[a-z_]+", error["code"]), reply
        assert error["code"] != "internal", f"an unexpected error for {what}: {error['message']}"
        assert isinstance(error["message"], str) and error["message"], reply
        event(f"{case.label or case.subject}: {error['code']}")
        return
    try:
        msgspec.json.decode(data, type=case.reply)
    except msgspec.ValidationError as e:
        pytest.fail(f"the answer to {what} is neither an error nor a valid reply: {e}: {data!r}")
    event(f"{case.label or case.subject}: answered")


async def _send_all(nc: Client, cases: list[Case], *procs: subprocess.Popen) -> None:
    answers = await asyncio.gather(*(_request(nc, c) for c in cases))
    for case, data in zip(cases, answers, strict=True):
        try:
            _check(case, data)
        except AssertionError as e:
            # An `internal` answer names only an id: the services' logs hold the why.
            for proc in procs:
                _no_tracebacks(proc)
            raise e from None


async def _still_serving(nc: Client, *procs: subprocess.Popen) -> None:
    for proc in procs:
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
    data = await _request(nc, Case(subjects.ctl("status"), b"{}"))
    assert data is not None, "status did not answer"
    msgspec.json.decode(data, type=StatusReply)


def _no_tracebacks(proc: subprocess.Popen) -> None:
    text = proc.log_path.read_text(errors="replace")  # type: ignore[attr-defined]
    assert "Traceback" not in text, text[text.index("Traceback") - 200 :][:4000]


async def _uploaded(nc: Client, data: bytes) -> str:
    return await blobs.put(await blobs.store(nc), data)


HELLO_SOURCE = load.load(HELLO).source
HELLO_VERSION = archive.digest(HELLO_SOURCE)


@pytest.fixture
async def controller(nc, start_controller):
    """One controller for all the examples of a test (Hypothesis runs them in one test call),
    with the example module's source in the object store, as `mesh push` leaves it."""
    proc = start_controller("ctl-a")
    await await_until(lambda: ask(nc, "mesh.ctl.status"), within=30, what="the controller")
    assert nc.max_payload >= MAX_PAYLOAD
    assert await _uploaded(nc, HELLO_SOURCE) == HELLO_VERSION
    return proc


async def _after(nc: Client, *procs: subprocess.Popen) -> None:
    """After every batch: alive, `status` answers, and no traceback in any log."""
    await _still_serving(nc, *procs)
    for proc in procs:
        _no_tracebacks(proc)


# --- the controller's verbs ------------------------------------------------------------------


def _operator_cases(name: str, verb: ctl_verbs.Verb) -> st.SearchStrategy[Case]:
    return st.builds(
        Case,
        subject=st.just(subjects.ctl(name)),
        body=bodies(verb.request, limit=verb.limit, max_payload=MAX_PAYLOAD),
        reply=st.just(verb.reply),
        label=st.just(name),
    )


def _host_side_cases(name: str, verb: ctl_verbs.Verb) -> st.SearchStrategy[Case]:
    """What a host asks; half of the near-valid bodies name the subject's machine, as a real
    host's do, so they get past the check that a machine speaks only for itself."""
    fields = {f.encode_name for f in msgspec.inspect.type_info(verb.request).fields}

    @st.composite
    def build(draw: st.DrawFn) -> Case:
        machine = draw(machines)
        if "name" in fields and draw(st.booleans()):
            body = draw(near_valid(verb.request, broken=draw(st.integers(0, 1))))
            body["name"] = machine
            data = dumps(body)
        else:
            data = draw(bodies(verb.request, limit=verb.limit, max_payload=MAX_PAYLOAD))
        return Case(subjects.ctl_host(machine, name), data, verb.reply, f"host {name}")

    return build()


@st.composite
def _pushes(draw: st.DrawFn, hello: str) -> Case:
    """push and diff with a manifest (random or near-valid) and a source that is stored."""
    verb = draw(st.sampled_from(["push", "diff"]))
    text = draw(st.one_of(manifests(Manifest), mutated_manifests(), st.just(GOOD)))
    body = {"manifest": text, "source": hello}
    if draw(st.booleans()):
        body["by"] = draw(st.text(max_size=30))
    reply = ctl_verbs.VERBS[verb].reply
    return Case(subjects.ctl(verb), dumps(body), reply, f"{verb} (stored source)")


def _controller_batches(hello: str) -> st.SearchStrategy[list[Case]]:
    """One body for every verb, a push or diff of a stored source, and an unknown verb."""
    parts = [_operator_cases(n, v) for n, v in sorted(ctl_verbs.VERBS.items())]
    parts += [_host_side_cases(n, v) for n, v in sorted(ctl_verbs.HOST_VERBS.items())]
    parts.append(_pushes(hello))
    parts.append(
        st.builds(
            Case, subject=tokens.map(subjects.ctl), body=st.binary(max_size=64), label=st.just("?")
        )
    )
    parts.append(
        st.builds(
            Case,
            subject=st.tuples(machines, tokens).map(lambda mv: subjects.ctl_host(*mv)),
            body=st.binary(max_size=64),
            label=st.just("host ?"),
        )
    )
    return st.tuples(*parts).map(list)


@settings(SERVICES, max_examples=_examples(300))
@given(batch=_controller_batches(HELLO_VERSION))
async def test_every_controller_verb_survives_fuzzed_bodies(nc, controller, batch) -> None:
    """A batch is one body for every verb (host-side verbs too), a push and a diff of a stored
    source, and unknown verbs, sent at once: 300 batches, over 5,000 requests."""
    await _send_all(nc, batch, controller)
    await _after(nc, controller)


_STREAMS = [
    (st.builds(subjects.host, machines, st.just("beat")), Beat),
    (machines.map(lambda m: f"mesh.event.{m}.applied"), Applied),
    (machines.map(lambda m: f"mesh.event.{m}.processes"), ProcessesEvent),
    (machines.map(lambda m: f"mesh.event.{m}.tools"), ToolsEvent),
    (st.sampled_from(["standby", "held", "released"]).map(subjects.seat), SeatAnnounce),
]
events = st.one_of(
    [
        st.tuples(subject, st.one_of(st.binary(max_size=200), near_valid(kind).map(dumps)))
        for subject, kind in _STREAMS
    ]
)


@settings(SERVICES, max_examples=_examples(100))
@given(batch=st.lists(events, min_size=10, max_size=30))
async def test_the_controller_survives_fuzzed_events(nc, controller, batch) -> None:
    """What hosts and controllers publish without a reply (beats, apply and process reports,
    seat announcements): garbage and near-valid bodies; `nodes` still answers and encodes."""
    for subject, body in batch:
        await nc.publish(subject, body)
    await nc.flush()
    await _after(nc, controller)
    data = await _request(nc, Case(subjects.ctl("nodes"), b"{}"))
    assert data is not None, "nodes did not answer"
    msgspec.json.decode(data, type=NodesReply)


# --- pushes of random archives through the real controller -----------------------------------

NAMES = st.one_of(
    st.sampled_from(["src", "src/hello.py", "module.toml", "src/lib", "src/lib/a", "a", "a/b",
                     ".", "", "..", "../x", "/abs", "src/../..", "a//b", "x" * 300]),
    st.text(max_size=12),
)  # fmt: skip
KINDS = st.sampled_from(
    [tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE,
     tarfile.CHRTYPE, tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE, b"Z"]
)  # fmt: skip


def _tar(entries: list[tuple[str, bytes, bytes, str, int]], fmt: int) -> bytes | None:
    out = io.BytesIO()
    try:
        with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
            for name, kind, data, link, mode in entries:
                info = tarfile.TarInfo(name)
                info.type, info.mode, info.linkname = kind, mode, link
                if kind in (tarfile.REGTYPE, tarfile.CONTTYPE):
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.addfile(info)
    except (ValueError, tarfile.TarError, UnicodeError):
        return None  # tarfile will not write it: nothing to fuzz
    return out.getvalue()


entries = st.lists(
    st.tuples(NAMES, KINDS, st.binary(max_size=40), NAMES, st.integers(0, 0o7777)), max_size=8
)
formats = st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])


@st.composite
def archives(draw: st.DrawFn, manifest: str | None = None) -> bytes:
    """Tar archives (with `manifest` as module.toml when given), mutated now and then, or bytes."""
    listed = draw(entries)
    if manifest is not None:
        listed.append(("module.toml", tarfile.REGTYPE, manifest.encode(), "", 0o644))
        if draw(st.booleans()):  # the example's own source folder: pushes that get through
            listed.append(("src", tarfile.DIRTYPE, b"", "", 0o755))
            listed.append(("src/hello.py", tarfile.REGTYPE, b"print('hi')\n", "", 0o644))
    data = _tar(listed, draw(formats))
    if data is None or draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=2000))
    if draw(st.integers(0, 4)) == 0:  # flip a few bytes
        mutable = bytearray(data)
        for _ in range(draw(st.integers(1, 6))):
            mutable[draw(st.integers(0, len(mutable) - 1))] = draw(st.integers(0, 255))
        data = bytes(mutable)
    return data


GOOD = (HELLO / "module.toml").read_text()


@st.composite
def mutated_manifests(draw: st.DrawFn) -> str:
    """The example module.toml with a few lines changed, dropped, added or tables repeated."""
    lines = GOOD.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        how = draw(st.sampled_from(["value", "value", "drop", "add", "repeat"]))
        if how == "value" and "=" in lines[i]:
            key = lines[i].split("=", 1)[0]
            lines[i] = f"{key}= {toml_value(draw(json_values))}"
        elif how == "drop":
            del lines[i]
        elif how == "add":
            key, value = draw(st.text(max_size=10)), draw(json_values)
            lines.insert(i, f"{toml_value(key)} = {toml_value(value)}")
        elif how == "repeat":  # many tables: the count limits
            n = draw(st.integers(1, 100))
            lines += [f'[account.fuzz{k}]\nhome = "/var/lib/f{k}"' for k in range(n)]
        if not lines:
            lines = [""]
    return "\n".join(lines) + "\n"


@settings(SERVICES, max_examples=_examples(200))
@given(
    manifest=st.one_of(mutated_manifests(), st.just(GOOD)),
    data=st.data(),
    verb=st.sampled_from(["push", "diff"]),
)
async def test_pushes_of_random_archives_get_clear_answers(
    nc, controller, manifest: str, data: st.DataObject, verb: str
) -> None:
    """The archive (holding the manifest as module.toml, or not) is put in the object store, as
    `mesh push` does, then pushed or diffed."""
    source = data.draw(archives(manifest if data.draw(st.booleans()) else None))
    digest = await _uploaded(nc, source)
    body = dumps({"manifest": manifest, "source": digest})  # diff takes no `by`
    reply = ctl_verbs.VERBS[verb].reply
    await _send_all(
        nc, [Case(subjects.ctl(verb), body, reply, f"{verb} (random archive)")], controller
    )
    await _after(nc, controller)


# --- the host's verbs ------------------------------------------------------------------------


_HOST_CASES = [
    st.builds(
        Case,
        subject=st.just(subjects.host("node-1", name)),
        body=bodies(verb.request, limit=verb.limit, max_payload=MAX_PAYLOAD),
        reply=st.just(verb.reply),
        label=st.just(f"host verb {name}"),
    )
    for name, verb in sorted(host_verbs.VERBS.items())
]


@settings(SERVICES, max_examples=_examples(200))
@given(batch=st.lists(st.tuples(*_HOST_CASES), min_size=1, max_size=3))
async def test_every_host_verb_survives_fuzzed_bodies(nc, host, batch) -> None:
    """One to three bodies for every verb of services/host/verbs.py on a real host, at once."""
    await _send_all(nc, [c for group in batch for c in group], host)
    await _after(nc, host)
    data = await _request(nc, Case(subjects.host("node-1", "status"), b"{}"))
    assert data is not None and not json.loads(data).get("error"), data


# --- size limits, exactly --------------------------------------------------------------------


def _padded(size: int) -> bytes:
    """A JSON object of exactly `size` bytes (whitespace inside the braces)."""
    return b"{" + b" " * (size - 2) + b"}"


async def test_every_verb_refuses_a_body_over_its_limit_by_name(nc, host) -> None:
    cases = []
    for name, verb in sorted(ctl_verbs.VERBS.items()):
        cases.append((subjects.ctl(name), verb.limit))
    for name, verb in sorted(ctl_verbs.HOST_VERBS.items()):
        cases.append((subjects.ctl_host("node-1", name), verb.limit))
    for name, verb in sorted(host_verbs.VERBS.items()):
        cases.append((subjects.host("node-1", name), verb.limit))
    for subject, limit in cases:
        if limit + 1 > nc.max_payload:
            continue  # the server refuses it before anyone could
        over = await ask(nc, subject, _padded(limit + 1), timeout=ANSWER_WITHIN)
        assert over["error"]["code"] == "too_large", (subject, over)
        assert f"at most {limit}" in over["error"]["message"]
        at = await ask(nc, subject, _padded(limit), timeout=ANSWER_WITHIN)
        assert at is not None and (at.get("error") or {}).get("code") != "too_large", subject
    await _still_serving(nc, host)


# --- in-process: the manifest and archive loaders --------------------------------------------


@settings(FUZZ, max_examples=_examples(600))
@given(text=st.one_of(manifests(Manifest), mutated_manifests()))
def test_the_gate_refuses_with_refused_only(text: str) -> None:
    """What the gate lets through also composes into a declaration that reads back the same."""
    try:
        manifest = gate.parse(text)
    except gate.Refused as e:
        assert str(e).startswith("module "), e
        assert "\n" not in str(e)  # one line, whatever the keys and values
        event("refused")
        return
    event("passed the gate")
    version = ModuleVersion(
        name=manifest.module.name,
        version="sha256:" + "0" * 64,
        manifest=manifest,
        bundles={name: "sha256:" + "1" * 64 for name in manifest.bundle},
    )
    try:
        body, _ = compose.encode(compose.merge("fuzz-1", [compose.prepare(version)]))
    except compose.Conflict:
        return
    again = msgspec.json.decode(body, type=compose.Declaration)
    assert compose.canonical(again) == body


@settings(FUZZ, max_examples=_examples(800))
@given(manifest=st.one_of(mutated_manifests(), st.just(GOOD)), data=st.data())
def test_module_sources_are_refused_with_refused_only(manifest: str, data: st.DataObject) -> None:
    """What the controller does with a pushed source, in the same order, in-process."""
    source = data.draw(archives(manifest))
    try:
        parsed = gate.parse(manifest)
    except gate.Refused:
        return
    try:
        load.check_sources(parsed, source)
        archive.read(source, "module.toml")
        for name, b in parsed.bundle.items():
            if b.kind == "system" or b.source is None:
                continue
            if b.build is None:
                load.bundle_archive(parsed, name, source)
            else:
                load.source_tree(source, b.source)
    except (gate.Refused, archive.ArchiveRefused):
        pass


@settings(FUZZ, max_examples=_examples(800))
@given(source=archives())
def test_archives_are_refused_with_archive_refused_only(source: bytes) -> None:
    """members, subtree, read and unpack (what a host does with a fetched bundle)."""
    for step in (
        lambda: archive.members(source),
        lambda: archive.subtree(source, "src"),
        lambda: archive.subtree(source, "a"),
        lambda: archive.read(source, "module.toml"),
    ):
        try:
            step()
        except archive.ArchiveRefused:
            pass
    with tempfile.TemporaryDirectory() as folder:
        try:
            archive.unpack(source, Path(folder) / "bundle")
        except archive.ArchiveRefused:
            pass


def test_known_names_are_valid() -> None:
    """The fuzzer's pool of names must be names, or it would test nothing past the name check."""
    from mesh.names import check_name

    for name in KNOWN_NAMES:
        check_name(name, field="name")
