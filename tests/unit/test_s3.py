"""The S3 backend against a real S3-compatible server (moto's, a subprocess on 127.0.0.1), through HTTP.

Faults (503/500 answers, stalls) come from ``FaultProxy``, a real HTTP forwarder between client and server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import pytest
import torch

pytest.importorskip("obstore")
pytest.importorskip("moto")

from clirun import liferaft_cli

import liferaft
from liferaft import JobOptions
from liferaft.errors import CheckpointNotFoundError, IncompleteCheckpointError, StorageError
from liferaft.storage import resolve
from liferaft.storage.s3 import S3Storage, S3StorageError
from liferaft.testing.s3server import FaultProxy, MotoS3Server
from liferaft.testing.storage_conformance import StorageConformance

MiB = 1 << 20
PART = 5 * MiB     # S3's smallest part: multipart files stay small


@pytest.fixture(scope="module")
def s3():
    """One moto server for the module; its endpoint and test credentials in the environment meanwhile."""
    with MotoS3Server() as server:
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())
        try:
            yield server
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture
def proxy(s3):
    with FaultProxy(s3.endpoint_url) as p:
        yield p


def _url(s3: MotoS3Server) -> str:
    return f"s3://{s3.bucket}/{uuid.uuid4().hex[:10]}"


def _ranges(proxy: FaultProxy, method: str = "GET") -> list[tuple[int, int]]:
    out = []
    for r in proxy.requests:
        if r.method == method and r.range and r.outcome == "forwarded":
            a, b = re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups()
            out.append((int(a), int(b) + 1))
    return out


class TestS3Conformance(StorageConformance):
    @pytest.fixture
    def st(self, s3):
        return S3Storage(_url(s3), part_size=PART)


def test_import_liferaft_does_not_import_the_client_and_s3_urls_resolve(s3):
    code = "import sys, liferaft; assert 'obstore' not in sys.modules and 'liferaft.storage.s3' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    st = resolve(f"s3://{s3.bucket}/a/b/")
    assert isinstance(st, S3Storage) and st.url == f"s3://{s3.bucket}/a/b" and st.remote and not st.process_local
    assert st.endpoint_url == s3.endpoint_url          # from AWS_ENDPOINT_URL, read at construction
    with pytest.raises(StorageError, match="no bucket"):
        S3Storage("s3:///x")


def _state(n: int = 3):
    g = torch.Generator().manual_seed(n)
    return {"model": {f"w{i}": torch.randn(64 + i, 32, generator=g) for i in range(n)},
            "big": torch.arange(300_000, dtype=torch.float32), "step": 7, "name": "run", "ids": [1, 2, 3]}


def _template(state):
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "big": torch.zeros_like(state["big"]), "step": 0, "name": "", "ids": []}


def _assert_same(a, b):
    assert a["step"] == b["step"] and a["name"] == b["name"] and a["ids"] == b["ids"]
    assert torch.equal(a["big"], b["big"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])


@pytest.mark.parametrize("how", ["url", "instance"])
def test_save_load_verify_roundtrip(s3, how):
    url = _url(s3)
    path = url if how == "url" else S3Storage(url, part_size=PART)
    state = _state()
    res = liferaft.save(path, state)
    assert res.path == url
    liferaft.verify(url)
    out = _template(state)
    liferaft.load(path, out)
    _assert_same(state, out)
    tree = liferaft.read(url)
    assert torch.equal(tree["big"], state["big"]) and tree["step"] == 7
    names = S3Storage(url).list()
    assert names[0] == "COMMIT" and any(n.startswith("manifest-") for n in names)
    assert any(n.startswith("data/") for n in names)
    # an overwrite replaces the checkpoint and removes the old files
    liferaft.save(path, {**state, "step": 8}, options=liferaft.SaveOptions(overwrite=True))
    assert liferaft.read(url)["step"] == 8 and len(S3Storage(url).list()) == len(names)


def test_async_save_to_s3(s3):
    url, state = _url(s3), _state(2)
    liferaft.async_save(url, state).wait()
    out = _template(state)
    liferaft.load(url, out)
    _assert_same(state, out)


def test_multipart_file_with_gaps_reads_back_exactly(s3, proxy):
    st = S3Storage(_url(s3), endpoint_url=proxy.url, part_size=PART, max_concurrency=2)
    rng = torch.Generator().manual_seed(0)
    size = 3 * PART + 12345
    expect = bytearray(size)
    w = st.open_writer("data/x/r00000.bin")
    off = 0
    while off < size:                                  # liferaft's pattern: increasing offsets, small zero gaps
        n = min(int(torch.randint(100_000, 900_000, (1,), generator=rng)), size - off)
        chunk = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).numpy().tobytes()
        w.pwrite(memoryview(chunk), off)
        expect[off:off + n] = chunk
        off += n + int(torch.randint(0, 4096, (1,), generator=rng))
    size = len(expect)
    assert s3.pending_uploads() == [f"{st.prefix}/data/x/r00000.bin"]    # parts go up before close()
    with pytest.raises(S3StorageError, match="already uploaded"):
        w.pwrite(b"late", 10)
    w.close()
    assert s3.pending_uploads() == []
    parts = [r for r in proxy.requests if r.method == "PUT" and "partNumber=" in r.path]
    assert len(parts) == 4
    assert st.size("data/x/r00000.bin") == size and st.read_all("data/x/r00000.bin") == bytes(expect)
    for start, n in [(0, 10), (PART - 5, 10), (2 * PART - 1, PART + 2), (size - 7, 100), (1, size + 50)]:
        buf = bytearray(n)
        got = st.read_into("data/x/r00000.bin", start, memoryview(buf))
        assert got == min(n, size - start) and bytes(buf[:got]) == bytes(expect[start:start + got])
    assert st.read_into("data/x/r00000.bin", size + 3, memoryview(bytearray(5))) == 0


def test_partial_load_fetches_only_the_needed_range(s3, proxy):
    url = _url(s3)
    full = torch.arange(1024 * 512, dtype=torch.float32).reshape(1024, 512)          # one 2 MiB chunk
    liferaft.save(url, {"w": full}, options=liferaft.SaveOptions(compression="off"))
    st = S3Storage(url, endpoint_url=proxy.url)
    part = liferaft.Sharded(torch.zeros(256, 512), (1024, 512), (256, 0))           # rows 256..511 only
    liferaft.load(st, {"w": part})
    assert torch.equal(part.local, full[256:512])
    got = [(a, b) for a, b in _ranges(proxy) if a or b - a > 64 * 1024 + 1]    # (small files' capped GETs)
    need = (256 * 512 * 4, 512 * 512 * 4)
    assert got and sum(b - a for a, b in got) <= (need[1] - need[0]) + 64 * 1024, got
    assert all(a >= need[0] - 4096 and b <= need[1] + 4096 for a, b in got), got


def test_503_twice_then_ok_save_succeeds(s3, proxy):
    url = _url(s3)
    st = S3Storage(url, endpoint_url=proxy.url, timeout=2, total_timeout=10)
    proxy.fail_next(2, status=503, methods={"PUT"})
    state = _state(2)
    liferaft.save(st, state)
    assert [r.outcome for r in proxy.requests].count("503") == 2
    out = _template(state)
    liferaft.load(url, out)
    _assert_same(state, out)


def test_persistent_500_raises_storage_error_in_bounded_time_and_commits_nothing(s3, proxy):
    url = _url(s3)
    st = S3Storage(url, endpoint_url=proxy.url, part_size=PART, timeout=1, total_timeout=2)
    proxy.fail_next(None, status=500, methods={"PUT"})          # every upload fails; reads, deletes work
    state = {"big": torch.arange(3 * PART // 4, dtype=torch.float32), "step": 1}   # 15 MiB: multipart
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="500"):
        liferaft.save(st, state)
    assert time.monotonic() - t0 < 15
    proxy.clear()
    direct = S3Storage(url)
    assert not direct.exists("COMMIT") and s3.pending_uploads() == []
    with pytest.raises((CheckpointNotFoundError, IncompleteCheckpointError)):
        liferaft.load(url, {"big": torch.zeros(3 * PART // 4), "step": 0})


def test_every_request_failing_or_stalling_raises_in_bounded_time(s3, proxy):
    url = _url(s3)
    liferaft.save(url, {"w": torch.ones(1000)})
    st = S3Storage(url, endpoint_url=proxy.url, timeout=0.5, total_timeout=1.5)
    proxy.fail_next(None, status=500)
    t0 = time.monotonic()
    with pytest.raises(StorageError):
        liferaft.save(st, {"w": torch.ones(1000)}, options=liferaft.SaveOptions(overwrite=True))
    assert time.monotonic() - t0 < 6
    proxy.clear()
    proxy.stall_next(None, 30, methods={"GET"})                  # the server takes the request, never answers
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="GET"):
        liferaft.load(st, {"w": torch.zeros(1000)})
    assert time.monotonic() - t0 < 6
    proxy.clear()
    out = {"w": torch.zeros(1000)}
    liferaft.load(url, out)                                      # the old checkpoint is untouched
    assert torch.equal(out["w"], torch.ones(1000))


def test_aborted_writer_leaves_no_object_and_no_pending_upload(s3):
    st = S3Storage(_url(s3), part_size=PART)
    w = st.open_writer("data/s/r0.bin")
    w.pwrite(bytes(2 * PART + 10), 0)
    assert s3.pending_uploads() == [f"{st.prefix}/data/s/r0.bin"]
    w.abort()
    w.abort()
    assert s3.pending_uploads() == [] and not st.exists("data/s/r0.bin") and st.list() == []
    w2 = st.open_writer("small")
    w2.pwrite(b"abc", 0)
    w2.close()
    w2.abort()                                                   # after close: removes the object
    assert st.list() == []


def test_manager_on_s3_saves_keeps_restores_and_skips_a_damaged_step(s3):
    url = _url(s3)
    state = {"w": torch.arange(6.0), "step": 0}
    with liferaft.CheckpointManager(url, every_steps=1, keep_last=2) as mgr:
        for step in range(4):
            state = {"w": torch.arange(6.0) * step, "step": step}
            mgr.maybe_save(step, state)
    with liferaft.CheckpointManager(url) as mgr:
        assert [(i.step, i.status) for i in mgr.steps()] == [(2, "committed"), (3, "committed")]
        # damage the newest step's data object: restore falls back to step 2 with a warning
        newest = resolve(f"{url}/step-0000000003")
        data = next(n for n in newest.list() if n.startswith("data/"))
        blob = bytearray(newest.read_all(data))
        blob[0] ^= 0xFF
        newest.put_atomic(data, bytes(blob))
        got = {"w": torch.zeros(6), "step": -1}
        with pytest.warns(UserWarning, match="step 3"):
            assert mgr.restore(got) == 2
        assert torch.equal(got["w"], torch.arange(6.0) * 2) and got["step"] == 2


def test_command_line_on_an_s3_root(s3, tmp_path):
    """ls, inspect, verify, diff, gc --dry-run and conversions both ways, run as the real command on s3:// URLs."""
    url = _url(s3)
    with liferaft.CheckpointManager(url, every_steps=1, keep_last=5, job=JobOptions(job_id="s3-cli")) as mgr:
        for step in range(3):
            mgr.maybe_save(step, {"w": torch.arange(12.0).reshape(3, 4) * step, "step": step})

    def run(*a, code=0):
        out = liferaft_cli(*a, timeout=120)
        assert out.returncode == code, out.stderr
        return out.stdout

    assert [line.split()[:2] for line in run("ls", url).splitlines()[1:]] == [["0", "committed"], ["1", "committed"],
                                                                             ["2", "committed"]]
    tree = run("inspect", f"{url}/step-0000000002").splitlines()
    assert any(line.split()[:4] == ["w", "float32", "[3,", "4]"] for line in tree)
    assert run("verify", f"{url}/step-0000000002").startswith("OK ")
    assert "changed  w" in run("diff", f"{url}/step-0000000001", f"{url}/step-0000000002", code=1)
    assert "would delete 2 step(s)" in run("gc", url, "--keep-last", "1", "--dry-run")
    run("convert", f"{url}/step-0000000002", str(tmp_path / "dcp"), "--to", "dcp")
    run("convert", str(tmp_path / "dcp"), f"{url}/imported", "--to", "liferaft")
    assert "identical" in run("diff", f"{url}/imported", f"{url}/step-0000000002")


def test_read_all_with_a_limit_fetches_at_most_limit_plus_one_bytes_in_one_ranged_get(s3, proxy):
    url = _url(s3)
    S3Storage(url).put_atomic("big", b"x" * (3 * MiB))
    S3Storage(url).put_atomic("small", b"abc")
    S3Storage(url).put_atomic("empty", b"")
    st = S3Storage(url, endpoint_url=proxy.url)
    proxy.clear()
    with pytest.raises(liferaft.CorruptCheckpointError, match="big holds more than the 1000 bytes"):
        st.read_all("big", limit=1000)                  # (as if replaced by a larger object after any HEAD)
    assert _ranges(proxy) == [(0, 1001)] and not [r for r in proxy.requests if r.method == "HEAD"]
    proxy.clear()
    assert st.read_all("small", limit=3) == b"abc" and st.read_all("empty", limit=10) == b""
    assert _ranges(proxy)[-2:] == [(0, 4), (0, 11)]     # one request each, the common small case
    with pytest.raises(FileNotFoundError):
        st.read_all("absent", limit=10)


@pytest.mark.parametrize("bad", ["step-0000000000/../x", "step-0000000000//x", "step-0000000002/data/../y"])
def test_a_key_no_liferaft_name_is_reported_once_and_the_other_steps_still_restore(s3, bad):
    import boto3

    url = _url(s3)
    with liferaft.CheckpointManager(url, every_steps=1, async_save=False) as mgr:
        for step in range(3):
            mgr.maybe_save(step, {"w": torch.full((4,), float(step))})
    boto3.client("s3", endpoint_url=s3.endpoint_url).put_object(Bucket=s3.bucket,
                                                                 Key=url.split("/", 3)[3] + "/" + bad, Body=b"x")
    with pytest.raises(StorageError, match=r"not a name liferaft writes.*delete") as e:
        S3Storage(url).list()
    assert "after retries" not in str(e.value) and bad.split("/")[0] in str(e.value)
    damaged = int(bad[5:15])
    steps = {i.step: i for i in liferaft.ls(url)}
    assert steps[damaged].status == "corrupt" and "not a name liferaft writes" in steps[damaged].reason
    assert [steps[s].status for s in range(3) if s != damaged] == ["committed"] * 2
    with pytest.warns(UserWarning, match="skipping step"), \
            liferaft.CheckpointManager(url, every_steps=1, async_save=False) as mgr:
        out = {"w": torch.zeros(4)}
        assert mgr.restore(out) == (1 if damaged == 2 else 2)
    for step in range(3):                               # nothing was deleted on the strength of a partial listing
        assert S3Storage(f"{url}/step-{step:010d}").exists("COMMIT")
