"""A tiny HTTP server for the `hello` example module: answers every GET with "hello\n"."""

import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    # SO_REUSEPORT: a start-first update runs the new version beside the old on the same port,
    # and two dev hosts on one machine can both run hello (the kernel spreads connections).
    allow_reuse_port = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args()
    with Server((args.host, args.port), Hello) as server:
        print(f"hello: listening on {args.host}:{args.port}", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
