"""The request plumbing shared by the HTTP fakes of the training services (Tinker, PyTRIO)."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler
from typing import Any


class FakeHTTPHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive and no access log; every GET and POST goes to
    :meth:`serve` with its method and raw body, which a fake's handler implements."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.serve("GET", b"")

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.serve("POST", self.rfile.read(length) if length else b"")

    def serve(self, method: str, raw: bytes) -> None:
        raise NotImplementedError

    def drop_connection(self) -> None:
        """Answer nothing: close the connection under the client (a dropped request)."""
        self.close_connection = True
        self.connection.shutdown(2)
