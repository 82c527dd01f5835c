"""A tool server in plain Python, standard library only: MCP over stdio, written by hand.

The mesh host launches it, writes JSON-RPC requests to its stdin, one per line, and reads its
answers from its stdout, one per line (the MCP stdio transport). Nothing here knows of the mesh
or of an MCP SDK: any program in any language that does this is a tool server. Its log is its
stderr (`mesh logs MACHINE files`); stdout carries MCP messages and nothing else.

Its tools work on its own folder, $MESH_FILES, where the host wrote the files its module
declares: list and read them, plus echo (a trivial tool), whoami, fail (a tool that reports an
error) and sleep (one that takes its time: calls run in threads, side by side).
"""

import json
import os
import sys
import threading
import time

FOLDER = os.path.realpath(os.environ.get("MESH_FILES", "."))
VERSION = os.environ.get("FILES_VERSION", "1")
MACHINE = sys.argv[sys.argv.index("--machine") + 1] if "--machine" in sys.argv else "?"
PAGE = 3  # tools per tools/list page: the host follows nextCursor
MOST = 256 * 1024  # bytes `read` returns

_out = threading.Lock()


def send(message: dict) -> None:
    line = json.dumps(message, separators=(",", ":")) + "\n"
    with _out:
        sys.stdout.write(line)
        sys.stdout.flush()


def text(value: str, *, error: bool = False) -> dict:
    return {"content": [{"type": "text", "text": value}], "isError": error}


def inside(rel: str) -> str:
    path = os.path.realpath(os.path.join(FOLDER, rel))
    if path != FOLDER and not path.startswith(FOLDER + os.sep):
        raise ValueError(f"{rel!r} is outside this tool server's folder")
    return path


def list_files(args: dict) -> dict:
    top = inside(args.get("path", "."))
    names = sorted(
        os.path.relpath(os.path.join(folder, name), FOLDER)
        for folder, _, files in os.walk(top)
        for name in files
        if not name.startswith(".")
    )
    return {**text("\n".join(names)), "structuredContent": {"files": names}}


def read(args: dict) -> dict:
    with open(inside(args["path"]), "rb") as f:
        return text(f.read(MOST).decode(errors="replace"))


def echo(args: dict) -> dict:
    return text(str(args.get("text", "")))


def whoami(args: dict) -> dict:
    me = {"machine": MACHINE, "uid": os.getuid(), "pid": os.getpid(), "version": VERSION}
    return {**text(json.dumps(me)), "structuredContent": me}


def fail(args: dict) -> dict:
    return text(str(args.get("message", "this tool always fails")), error=True)


def sleep(args: dict) -> dict:
    seconds = float(args.get("seconds", 1))
    time.sleep(min(seconds, 3600))
    return text(f"slept {seconds:g}s")


def _schema(**properties: dict) -> dict:
    return {"type": "object", "properties": properties}


TOOLS = {
    "list": (
        list_files,
        "the files in this server's folder ($MESH_FILES), or under path",
        _schema(path={"type": "string"}),
    ),
    "read": (
        read,
        "a file of this server's folder, as text (at most 256 KiB)",
        {**_schema(path={"type": "string"}), "required": ["path"]},
    ),
    "echo": (echo, "the text it is given", _schema(text={"type": "string"})),
    "whoami": (whoami, "the machine, account and pid this server runs as", _schema()),
    "fail": (
        fail,
        "always fails, with the message it is given",
        _schema(message={"type": "string"}),
    ),
    "sleep": (sleep, "sleeps for a number of seconds", _schema(seconds={"type": "number"})),
}
LISTED = [{"name": n, "description": d, "inputSchema": s} for n, (_, d, s) in TOOLS.items()]


def call(ident, params: dict) -> None:
    name = params.get("name")
    if name not in TOOLS:
        send(
            {
                "jsonrpc": "2.0",
                "id": ident,
                "error": {"code": -32602, "message": f"unknown tool {name!r}"},
            }
        )
        return
    try:
        result = TOOLS[name][0](params.get("arguments") or {})
    except Exception as e:  # a tool that fails says so in its result (MCP: isError)
        result = text(f"{type(e).__name__}: {e}", error=True)
    send({"jsonrpc": "2.0", "id": ident, "result": result})


def answer(message: dict) -> None:
    method, ident, params = message.get("method"), message.get("id"), message.get("params") or {}
    if ident is None:
        return  # a notification: initialized, cancelled (a sleeping call just ends late)
    if method == "initialize":
        asked = params.get("protocolVersion")
        known = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
        result = {
            "protocolVersion": asked if asked in known else known[-1],
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": "files", "version": VERSION},
        }
    elif method == "ping":
        result = {}
    elif method == "tools/list":
        start = int(params.get("cursor") or 0)
        result = {"tools": LISTED[start : start + PAGE]}
        if start + PAGE < len(LISTED):
            result["nextCursor"] = str(start + PAGE)
    elif method == "tools/call":
        threading.Thread(target=call, args=(ident, params), daemon=True).start()
        return
    else:
        send(
            {
                "jsonrpc": "2.0",
                "id": ident,
                "error": {"code": -32601, "message": f"no method {method}"},
            }
        )
        return
    send({"jsonrpc": "2.0", "id": ident, "result": result})


def main() -> None:
    print(f"files {VERSION} on {MACHINE}: serving {FOLDER}", file=sys.stderr, flush=True)
    for line in sys.stdin:  # until the host closes our stdin: then we exit
        if line.strip():
            answer(json.loads(line))
    print("stdin closed: exiting", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
