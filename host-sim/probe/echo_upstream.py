#!/usr/bin/env python3
"""Upstream for the probe's Envoy check: answers every request with the
request as JSON (method, path, headers in arrival order, body length), so a
client sees what the upstream saw.

    python3 host-sim/probe/echo_upstream.py [port]    # default 18081

`/status/<n>` answers with status n. Standard library only.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _body(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("content-length", 0) or 0))

    def _answer(self):
        body = self._body()
        status = 200
        if self.path.startswith("/status/"):
            status = int(self.path.rsplit("/", 1)[1])
        seen = {
            "method": self.command,
            "path": self.path,
            "headers": [[k.lower(), v] for k, v in self.headers.items()],
            "body_bytes": len(body),
        }
        out = (json.dumps(seen) + "\n").encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

    def log_message(self, fmt, *args):
        sys.stderr.write("echo: " + (fmt % args) + "\n")


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 18081
    ThreadingHTTPServer(("127.0.0.1", port), Echo).serve_forever()
