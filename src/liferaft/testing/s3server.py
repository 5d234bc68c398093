"""A real S3-compatible server for tests (moto's, in a subprocess on 127.0.0.1) and a fault-injecting HTTP proxy.

::

    with MotoS3Server() as s3:                       # starts, waits until it answers, creates s3.bucket
        st = S3Storage(f"s3://{s3.bucket}/ck", endpoint_url=s3.endpoint_url)   # env: s3.env()
        with FaultProxy(s3.endpoint_url) as proxy:   # put it between client and server
            proxy.fail_next(2, status=503)           # the next two requests get 503 SlowDown
            st = S3Storage(..., endpoint_url=proxy.url)

In a pytest module: ``@pytest.fixture(scope="module") def s3(): with MotoS3Server() as s: yield s``.
Needs ``moto[server]`` (the ``test`` extra); the proxy is standard library only.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Self

from liferaft.testing.launcher import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def _http(method: str, url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class MotoS3Server:
    """moto's S3 server as a subprocess on a free 127.0.0.1 port, with one bucket (``bucket``) made."""

    def __init__(self, bucket: str | None = None, start_timeout: float = 60.0) -> None:
        self.bucket = bucket or f"liferaft-{uuid.uuid4().hex[:8]}"
        self.start_timeout = start_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment variables that point an S3 client (``S3Storage``, boto3) at this server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint_url}

    def start(self) -> MotoS3Server:
        self.port = free_port()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - open for the server's life, closed by stop()
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                      stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS})
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._proc.poll() is not None:
                self._log.seek(0)
                log = self._log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"moto server exited with code {self._proc.returncode}: {log}")
            try:
                if _http("GET", self.endpoint_url + "/", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto server did not answer on port {self.port} within {self.start_timeout} s")
            time.sleep(0.1)
        self.create_bucket(self.bucket)
        return self

    def create_bucket(self, name: str) -> None:
        status, body = _http("PUT", f"{self.endpoint_url}/{name}")
        if status != 200:
            raise RuntimeError(f"creating bucket {name!r} failed: {status} {body[:300]!r}")

    def pending_uploads(self, bucket: str | None = None) -> list[str]:
        """Keys of multipart uploads started and neither completed nor aborted."""
        status, body = _http("GET", f"{self.endpoint_url}/{bucket or self.bucket}?uploads")
        if status != 200:
            raise RuntimeError(f"listing multipart uploads failed: {status} {body[:300]!r}")
        return re.findall(r"<Upload>.*?<Key>(.*?)</Key>", body.decode(), flags=re.DOTALL)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class _Rule:
    kind: str                      # "status" | "drop" | "stall"
    count: int | None              # requests left to hit (None: every one)
    status: int = 503
    seconds: float = 0.0
    methods: frozenset[str] | None = None
    path_has: str | None = None    # only requests whose path (query included) holds this


@dataclass
class ProxiedRequest:
    method: str
    path: str
    range: str | None
    outcome: str                   # "forwarded", "503", "drop", "stall"


_REASONS = {500: ("Internal Server Error", "InternalError"), 503: ("Slow Down", "SlowDown")}


@dataclass
class FaultProxy:
    """An HTTP/1.1 forwarder on a free 127.0.0.1 port in front of ``upstream`` (``http://host:port``) that can
    answer requests with an error status, drop their connection or stall them. Every request is logged in
    ``requests`` (method, path, Range header, outcome). Thread per connection; ``stop()`` closes everything."""

    upstream: str
    port: int = 0
    requests: list[ProxiedRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        host, _, port = self.upstream.removeprefix("http://").rstrip("/").partition(":")
        self._up = (host, int(port or 80))
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- faults ------------------------------------------------------------------------------------------------
    def fail_next(self, n: int | None, status: int = 503, methods: set[str] | None = None) -> None:
        """Answer the next ``n`` requests (None: all, until ``clear()``) with ``status`` (S3-style XML error)."""
        self._add(_Rule("status", n, status=status, methods=frozenset(methods) if methods else None))

    def drop_next(self, n: int | None, methods: set[str] | None = None) -> None:
        """Close the connection of the next ``n`` requests without answering."""
        self._add(_Rule("drop", n, methods=frozenset(methods) if methods else None))

    def stall_next(self, n: int | None, seconds: float, methods: set[str] | None = None,
                   path_has: str | None = None) -> None:
        """Hold the next ``n`` requests ``seconds`` without answering, then close their connection (only those
        whose path, query included, holds ``path_has`` if given: ``"list-type"`` for LISTs)."""
        self._add(_Rule("stall", n, seconds=seconds, methods=frozenset(methods) if methods else None,
                        path_has=path_has))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _match(self, method: str, path: str) -> _Rule | None:
        with self._lock:
            for r in self._rules:
                if (r.count is None or r.count > 0) and (r.methods is None or method in r.methods) and \
                        (r.path_has is None or r.path_has in path):
                    if r.count is not None:
                        r.count -= 1
                    return r
        return None

    # -- serving -----------------------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for s in list(self._socks):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._socks.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(60)
        rfile = conn.makefile("rb")
        try:
            while not self._stopping.is_set():
                head = _read_head(rfile)
                if head is None:
                    return
                method, path, headers, lines = head
                if headers.get("expect", "").lower() == "100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    lines = [ln for ln in lines if not ln.lower().startswith(b"expect:")]
                body = _read_body(rfile, headers)
                rule = self._match(method, path)
                outcome = "forwarded" if rule is None else (str(rule.status) if rule.kind == "status" else rule.kind)
                with self._lock:
                    self.requests.append(ProxiedRequest(method, path, headers.get("range"), outcome))
                if rule is not None and rule.kind != "status":
                    if rule.kind == "stall":
                        self._stopping.wait(rule.seconds)
                    return                                   # drop: close without an answer
                if rule is not None:
                    reason, code = _REASONS.get(rule.status, ("Error", "InternalError"))
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                           f"<Message>injected by FaultProxy</Message></Error>").encode()
                    conn.sendall(f"HTTP/1.1 {rule.status} {reason}\r\nContent-Type: application/xml\r\n"
                                 f"Content-Length: {len(xml)}\r\nConnection: close\r\n\r\n".encode() + xml)
                    return
                if not self._forward(conn, method, lines, body):
                    return
        except (OSError, ValueError):              # client or server went away, or sent garbage: drop it
            return
        finally:
            with self._lock:
                self._socks.discard(conn)
            rfile.close()
            conn.close()

    def _forward(self, conn: socket.socket, method: str, lines: list[bytes], body: bytes) -> bool:
        """Send one request upstream on a fresh connection (``Connection: close``) and relay the answer; True
        if the client connection may carry another request."""
        lines = [ln for ln in lines if not ln.lower().startswith(b"connection:")] + [b"Connection: close"]
        with socket.create_connection(self._up, timeout=60) as up:
            up.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            upfile = up.makefile("rb")
            head = _read_head(upfile, response=True)
            if head is None:
                return False
            _, _, headers, rlines = head
            status = int(rlines[0].split()[1])
            framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
            no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
            data = b"" if no_body else (_read_body(upfile, headers) if framed else upfile.read())
            rlines = [ln for ln in rlines if not ln.lower().startswith(b"connection:")]
            if not framed and not no_body:
                rlines.append(f"Content-Length: {len(data)}".encode())
            conn.sendall(b"\r\n".join(rlines) + b"\r\n\r\n" + data)
            upfile.close()
        return True


def _read_head(f: Any, response: bool = False) -> tuple[str, str, dict[str, str], list[bytes]] | None:
    """Request (or status) line and headers, as (method, path, lower-cased headers, raw lines); None at EOF."""
    lines: list[bytes] = []
    while True:
        line = f.readline(65537)
        if not line:
            return None
        line = line.rstrip(b"\r\n")
        if not line:
            if lines:
                break
            continue
        lines.append(line)
    first = lines[0].decode("latin-1").split()
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    if response:
        return "", "", headers, lines
    return first[0], first[1] if len(first) > 1 else "", headers, lines


def _read_body(f: Any, headers: dict[str, str]) -> bytes:
    """The body as sent (chunked bodies are kept chunked, with their framing)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = []
        while True:
            size_line = f.readline(65537)
            out.append(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:                                  # trailers, then the empty line
                    t = f.readline(65537)
                    out.append(t)
                    if t in (b"\r\n", b"\n", b""):
                        return b"".join(out)
            out.append(f.read(size + 2))
    n = int(headers.get("content-length", "0") or 0)
    return f.read(n) if n else b""
