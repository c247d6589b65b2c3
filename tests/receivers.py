"""Loopback HTTP receivers standing in for a webhook endpoint and a Prometheus Alertmanager."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """Records every JSON POST as (path, body); answers 200 (Alertmanager's /api/v2/alerts too)."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, Any]] = []
        received = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                received.append((self.path, json.loads(self.rfile.read(length))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def take(self) -> list[tuple[str, Any]]:
        posts = list(self.posts)
        self.posts.clear()
        return posts


class Loopback:
    """An HTTP server on 127.0.0.1 that answers every request with ``answer(method, path, body)`` →
    ``(status, headers, body)`` and records each request's (method, path, headers)."""

    def __init__(self, answer) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def handle_one(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.command, self.path, dict(self.headers)))
                status, headers, out = answer(self.command, self.path, body)
                self.send_response(status)
                for name, value in {**headers, "Content-Length": str(len(out))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = handle_one

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
