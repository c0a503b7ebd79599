"""A fault-injecting HTTP range server on 127.0.0.1, for the remote-read tests and benchmarks/remote.py.

It serves the files of a directory (over TLS if given a certificate) with HEAD and single-range GET, an ETag
that changes when a file is replaced (size and mtime in nanoseconds), and
``If-Match`` (412 when the ETag differs; ``honour_if_match = False`` ignores
it), over HTTP/1.1 keep-alive connections. Each request first sleeps
``latency`` seconds (an object store's first-byte time). Faults are queued
with :meth:`FaultServer.inject` and each is spent by the next GET of a path:

- ``"503"``, ``"500"``, ``"429"``: that status, no body;
- ``"reset"``: headers and half of the body, then the connection is reset;
- ``"drop"``: the connection is closed before any answer;
- ``"stall"``: the request is read and never answered, the connection kept open
  (until the server shuts down): what a client without a bound of its own waits on;
- ``"stall-body"``: headers and half of the body, then nothing more, the connection kept open;
- ``"ok"``: answered as without a fault (to fault a later GET, not the next).

A GET of a directory (a listing) takes its faults too (``"503"``, ``"drop"``, ``"stall"``), queued
under the directory's path as the client asks for it (fsspec asks for ``/dir/``). A HEAD (fsspec's
``info``: a size, an identity) takes only the faults queued for it with ``inject(path, ..., method="HEAD")``.

Every request is logged as ``(method, path, start, length, status)``; a request for a directory
(fsspec lists one by GETting it: a page of links) is logged as method ``LIST``.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import struct
import threading
import time
from collections import deque
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import unquote


class Request(NamedTuple):
    method: str
    path: str
    start: int
    length: int
    status: int


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, as object stores serve
    # TCP_NODELAY, as servers set it: with Nagle the body waits for the client's delayed ACK
    # of the headers, 40 ms a response on loopback.
    disable_nagle_algorithm = True

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        time.sleep(owner.latency)
        path = os.path.join(owner.root, unquote(self.path.lstrip("/").split("?")[0]))
        fault = owner.take_fault(self.path if body else "HEAD " + self.path)
        if fault == "stall":
            self._log(0, 0, 0)
            self._stall()
            return
        if os.path.isdir(path) and fault not in ("drop", "503", "500", "429"):
            self._list(path, body)
            return
        if fault == "drop":
            self._log(0, 0, 0)
            self._reset()
            return
        if fault in ("503", "500", "429"):
            self._log(0, 0, int(fault))
            self.send_response(int(fault))
            self.send_header("Content-Length", "0")
            if fault == "429":
                self.send_header("Retry-After", "0")
            self.end_headers()
            return
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                etag = f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"'
                self._answer(f, stat.st_size, etag, body, fault)
        except FileNotFoundError:
            self._log(0, 0, 404)
            self.send_error(HTTPStatus.NOT_FOUND)

    def _answer(self, f, size: int, etag: str, body: bool, fault: str | None) -> None:  # type: ignore[no-untyped-def]
        wanted = self.headers.get("If-Match") if self.server.owner.honour_if_match else None
        if wanted is not None and wanted != etag:
            self._log(0, 0, 412)
            self.send_response(HTTPStatus.PRECONDITION_FAILED)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, stop, status = 0, size, HTTPStatus.OK
        ranges = self.headers.get("Range", "") if self.server.owner.honour_range else ""
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", ranges)
        if match:
            start = int(match.group(1))
            stop = min(size, int(match.group(2)) + 1) if match.group(2) else size
            status = HTTPStatus.PARTIAL_CONTENT
        self._log(start, stop - start if body else 0, int(status))
        self.send_response(status)
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        if self.server.owner.send_length or not body:
            self.send_header("Content-Length", str(stop - start))
        else:  # the body ends where the connection does
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.end_headers()
        if not body:
            return
        f.seek(start)
        data = f.read(stop - start)
        if fault in ("reset", "stall-body"):
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            if fault == "stall-body":
                self._stall()
            self._reset()
            return
        self.wfile.write(data)

    def _list(self, directory: str, body: bool) -> None:
        """A directory as an HTML page of links, as fsspec's HTTP filesystem lists (logged as ``LIST``)."""
        names = sorted(os.listdir(directory))
        page = "".join(f'<a href="{name}">{name}</a>\n' for name in names).encode()
        self.server.owner.log.append(Request("LIST", self.path, 0, len(page), 200))
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self.wfile.write(page)

    def _log(self, start: int, length: int, status: int) -> None:
        self.server.owner.log.append(Request(self.command, self.path, start, length, status))

    def _stall(self) -> None:
        """Keep the connection open without a word until the server shuts down (no sleep: an event)."""
        self.server.owner.released.wait()
        self.close_connection = True

    def _reset(self) -> None:
        """Close with a TCP reset (SO_LINGER 0), as a dropped connection looks to the client."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultServer

    def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        """A client that hangs up early (a cancelled readahead, a loader shut down) is not news."""


class FaultServer:
    """Serve ``root`` on 127.0.0.1 (a free port) with ``latency`` seconds per request; a context manager."""

    def __init__(self, root: str, latency: float = 0.0, tls: tuple[str, str] | None = None) -> None:
        """``tls``: ``(cert.pem, key.pem)`` to serve HTTPS instead of plain HTTP."""
        self.root = root
        self.latency = latency
        self.honour_if_match = True  # False: a store that ignores If-Match (the ETag it answers still tells)
        self.honour_range = True  # False: a server that answers every GET with the whole file
        self.send_length = True  # False: bodies without Content-Length, ended by closing the connection
        self.log: list[Request] = []
        self.released = threading.Event()  # set on shutdown: stalled handlers let go of their connections
        self._faults: dict[str, deque[str]] = {}
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        # A short poll: shutdown() waits for the serve loop to look, 0.5 s by default, once per test.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._server.server_address[1]}"

    def inject(self, path: str, *faults: str, method: str = "GET") -> None:
        """Queue ``faults`` for the next GETs (or HEADs, ``method="HEAD"``) of ``/path``, one each."""
        key = ("HEAD " if method == "HEAD" else "") + "/" + path.lstrip("/")
        with self._lock:
            self._faults.setdefault(key, deque()).extend(faults)

    def take_fault(self, path: str) -> str | None:
        with self._lock:
            queue = self._faults.get(path)
            return queue.popleft() if queue else None

    def gets(self, path: str | None = None) -> list[Request]:
        """The GET requests logged (of ``/path`` only, if given)."""
        return [r for r in self.log if r.method == "GET" and (path is None or r.path == "/" + path.lstrip("/"))]

    def __enter__(self) -> FaultServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


class _CountingHandler(_Handler):
    """Also answers ``GET /_stats`` with the requests served since the last such call (JSON), then resets."""

    def do_GET(self) -> None:
        if self.path == "/_stats":
            import json

            owner = self.server.owner
            log, owner.log = owner.log, []
            body = json.dumps(
                {
                    "GET": sum(r.method == "GET" for r in log),
                    "HEAD": sum(r.method == "HEAD" for r in log),
                    "LIST": sum(r.method == "LIST" for r in log),
                    "bytes": sum(r.length for r in log),
                }
            ).encode()
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.fault_server ROOT LATENCY``: serve until killed; prints the base URL first."""
    import sys

    root, latency = (argv or sys.argv[1:])[:2]
    server = FaultServer(root, float(latency))
    server._server.RequestHandlerClass = _CountingHandler
    print(server.url, flush=True)
    server._server.serve_forever()


if __name__ == "__main__":
    main()
