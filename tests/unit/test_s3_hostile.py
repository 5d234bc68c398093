"""S3Storage against a hostile or broken server (a real HTTP server in this process, answering as the test says):
every answer that contradicts itself is an S3StorageError naming the object, never bytes taken as data; nothing
is kept beyond what was asked; listings stay inside the prefix and end; URLs name one bucket and hold no secret.
Found by a hostile review (2026-12-06); the well-behaved server is moto, in test_s3.py."""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from liferaft.errors import LiferaftError, StorageError
from liferaft.storage.s3 import S3Storage, S3StorageError

DATA = bytes(range(256)) * 4                    # a 1,024-byte object


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        if n:
            self.rfile.read(n)
        url = urllib.parse.urlsplit(self.path)
        status, headers, body = self.server.answer(self.command, urllib.parse.unquote(url.path),  # type: ignore[attr-defined]
                                                   urllib.parse.parse_qs(url.query), self.headers.get("range"))
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), "ETag": '"e"',
                     "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT", **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_DELETE = do_POST = _answer


@pytest.fixture
def server(monkeypatch):
    """``server(answer)`` → an S3Storage of ``s3://bkt/ck`` on a server answering ``answer(method, path, query,
    range)`` with (status, headers, body)."""
    for var, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(var, value)
    servers = []

    def make(answer: Callable[..., tuple[int, dict, bytes]], prefix: str = "ck", timeout: float = 3,
             total_timeout: float = 4) -> S3Storage:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        srv.daemon_threads = True
        srv.answer = answer                                    # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return S3Storage(f"s3://bkt/{prefix}", endpoint_url=f"http://127.0.0.1:{srv.server_address[1]}",
                         timeout=timeout, total_timeout=total_timeout, retries=0)

    yield make
    for srv in servers:
        srv.shutdown()


def _ranged(cut: int = 0, extra: bytes = b"", claim: tuple[int, int] | None = None):
    """An object of DATA whose ranged GETs send ``cut`` bytes fewer, ``extra`` bytes more, or claim another range."""
    def answer(method, path, query, rng):
        if method == "HEAD":
            return 200, {"Content-Length": str(len(DATA))}, b""
        a, b = map(int, rng.split("=")[1].split("-"))
        b = min(b, len(DATA) - 1)
        lo, hi = claim or (a, b)
        return 206, {"Content-Range": f"bytes {lo}-{hi}/{len(DATA)}"}, DATA[a:b + 1 - cut] + extra
    return answer


@pytest.mark.parametrize("answer,match", [
    (_ranged(cut=3), "sent .* of the .* bytes .* \\(truncated\\)"),
    (_ranged(extra=b"x" * 64), "sent more than"),
    (_ranged(extra=b"x" * (8 << 20)), "sent more than"),
])
def test_a_body_that_is_not_the_range_announced_is_refused(server, answer, match):
    st = server(answer)
    for call in (lambda: st.read_all("COMMIT", 50), lambda: st.read_into("data/r0.bin", 10, memoryview(bytearray(100))),
                 lambda: st.read_into("data/r0.bin", 0, memoryview(bytearray(8 << 20)))):
        with pytest.raises(S3StorageError, match=f"s3://bkt/ck/.*: the server {match}"):
            call()


def test_a_416_inside_the_object_is_refused_and_one_past_its_end_is_the_end(server):
    def answer(method, path, query, rng):
        if method == "HEAD":
            return 200, {"Content-Length": str(len(DATA))}, b""
        return 416, {"Content-Range": f"bytes */{len(DATA)}"}, b"<Error><Code>InvalidRange</Code></Error>"
    st = server(answer)
    with pytest.raises(S3StorageError, match="refused bytes 10.. of an object of 1024 bytes"):
        st.read_into("data/r0.bin", 10, memoryview(bytearray(100)))
    with pytest.raises(S3StorageError, match="refused bytes 0.."):
        st.read_all("LEASE", 1 << 20)
    assert st.read_into("data/r0.bin", 2048, memoryview(bytearray(100))) == 0


def _listing(pages: Callable[[int], tuple[list[str], bool]]):
    """A ListObjectsV2 whose page n is ``pages(n)`` = (keys, truncated); always the same continuation token."""
    def answer(method, path, query, rng):
        n = int(query.get("continuation-token", ["0"])[0])
        keys, more = pages(n)
        items = "".join(f"<Contents><Key>{k}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
                        f"<ETag>\"x\"</ETag><Size>1</Size></Contents>" for k in keys)
        token = f"<NextContinuationToken>{n + 1}</NextContinuationToken>" if more else ""
        return 200, {}, (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bkt</Name>'
                         f"<KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>"
                         f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>{token}{items}"
                         "</ListBucketResult>").encode()
    return answer


@pytest.mark.parametrize("pages,match", [
    (lambda n: (["ck/step-1/COMMIT", "other/step-1/COMMIT"], False), "'other/step-1/COMMIT' lies outside"),
    (lambda n: (["ck/step-1/COMMIT", "ckx/step-1/COMMIT"], False), "'ckx/step-1/COMMIT' lies outside"),
    (lambda n: (["ck/step-1/COMMIT"], True), "is listed twice"),          # the same page forever
])
def test_a_listing_outside_the_prefix_or_that_repeats_itself_is_refused(server, pages, match):
    with pytest.raises(S3StorageError, match=match):
        server(_listing(pages)).list()


def test_a_listing_that_never_ends_stops(server):
    st = server(_listing(lambda n: ([f"ck/k{n:08d}-{i:04d}" for i in range(1000)], True)), timeout=2,
                total_timeout=2)            # (the listing's bound: 4 × 2 s; each page answers in far less)
    with pytest.raises(S3StorageError, match="still going after 8 s"):
        st.list()


@pytest.mark.parametrize("url", ["s3://../victim/ck", "s3://bkt?x=/ck", "s3://bkt#/ck", "s3://a/ck", "s3://b..c/ck",
                                 "s3://-bkt/ck", "s3://bk%2Ft/ck"])
def test_a_url_names_one_bucket_or_is_refused(url):
    with pytest.raises(StorageError, match="not a bucket name"):
        S3Storage(url, endpoint_url="http://127.0.0.1:9")


def test_credentials_are_never_echoed(monkeypatch):
    with pytest.raises(LiferaftError) as e:
        S3Storage("s3://AKIA:hunter2@bkt/ck", endpoint_url="http://127.0.0.1:9")
    assert "hunter2" not in str(e.value) and "AKIA" not in str(e.value) and "credentials" in str(e.value)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    st = S3Storage("s3://bkt/ck", endpoint_url="http://user:SECRET@127.0.0.1:9")
    assert "SECRET" not in repr(st) and "***@127.0.0.1:9" in repr(st)


def test_folder_markers_are_no_objects_of_the_listing(server):
    """The prefix's folder marker ("ck/": "Create folder" in the console, rclone, s3fs) is skipped, not taken for a
    key outside the prefix (which stopped every listing of such a root); markers inside it list as before."""
    st = server(_listing(lambda n: (["ck/", "ck/step-0000000001/", "ck/step-0000000001/COMMIT"], False)))
    assert "step-0000000001/COMMIT" in st.list()
