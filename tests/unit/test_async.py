"""async_save: same results as save, snapshots isolated from later changes, budget honoured, errors surfaced."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from saving import MODES, save_with

import liferaft
from liferaft.core import process as _process
from liferaft.staging import pool as pool_module
from liferaft.storage import register_scheme
from liferaft.testing.faults import FailingStorage, GatedStorage


def make_state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(700, 1000, generator=g), "t": torch.randn(300, 200, generator=g).t(),
            "s": torch.tensor(2.5), "b": torch.arange(10).to(torch.bfloat16), "e": torch.empty(0, 4),
            "meta": {"step": 4, "tag": "x"}}


@pytest.mark.parametrize("mode", MODES)
def test_every_save_path_gives_the_same_checkpoint(tmp_path, mode):
    state = make_state()
    res = save_with(mode, str(tmp_path / "ck"), state, block_size=65536)
    assert res.total_bytes >= 700 * 1000 * 4 and res.timings["total"] > 0
    liferaft.verify(str(tmp_path / "ck"))
    got = liferaft.read(str(tmp_path / "ck"))
    for k in ("w", "t", "s", "b", "e"):
        assert torch.equal(got[k], state[k]), k
    assert got["meta"] == {"step": 4, "tag": "x"}
    # the hashes are the same whichever path wrote them
    ref = str(tmp_path / "ref")
    liferaft.save(ref, state, options=liferaft.SaveOptions(block_size=65536))
    a = {t.key: t for t in liferaft.inspect(str(tmp_path / "ck")).tensors}
    assert a.keys() == {t.key for t in liferaft.inspect(ref).tensors}
    # byte-identical data file, whichever path (buffered / O_DIRECT, whole / pieces) wrote it
    files = [sorted((p.name, p.read_bytes()) for p in (tmp_path / d).rglob("*.bin"))
             for d in ("ck", "ref")]
    assert [b for _, b in files[0]] == [b for _, b in files[1]]


@pytest.mark.parametrize("staging", ["blocking", "overlapped"])
def test_snapshot_is_isolated_from_later_updates(tmp_path, staging):
    state = make_state()
    before = state["w"].clone()
    h = liferaft.async_save(str(tmp_path / "ck"), state, options=liferaft.SaveOptions(staging=staging))
    h.wait_staged()                      # right before the optimizer step
    state["w"].add_(1.0)                 # training goes on and changes every value
    state["meta"]["step"] = 99
    h.wait()
    got = liferaft.read(str(tmp_path / "ck"))
    assert torch.equal(got["w"], before) and got["meta"]["step"] == 4


def test_waves_keep_memory_within_the_budget_and_reuse_the_pool(tmp_path):
    state = {"w": torch.randn(2048, 1024)}       # 8 MiB through a 1 MiB pool
    budget = 1 << 20
    r1 = save_with("async-waves", str(tmp_path / "a"), state, memory_budget=budget)
    pool = _process.PROCESS.pool
    assert pool is not None and pool.capacity <= budget + 64 and pool.high_water <= pool.capacity
    assert r1.staging_bytes == pool.capacity
    ptr = pool.buffer.data_ptr()
    save_with("async-waves", str(tmp_path / "b"), state, memory_budget=budget)
    assert _process.PROCESS.pool is pool and pool.buffer.data_ptr() == ptr       # reused, no new pages
    for p in ("a", "b"):
        assert torch.equal(liferaft.read(str(tmp_path / p))["w"], state["w"])


def test_sync_save_streams_through_a_bounded_ring(tmp_path):
    _process.PROCESS.pool = _process.PROCESS.ring = None
    state = {"w": torch.randn(4096, 1024)}       # 16 MiB
    liferaft.save(str(tmp_path / "a"), state)
    ring = _process.PROCESS.ring
    assert ring is not None and ring.capacity <= _process.SYNC_RING and ring.high_water <= ring.capacity
    assert _process.PROCESS.pool is None          # a sync save never allocates a whole-snapshot pool
    liferaft.save(str(tmp_path / "b"), state, options=liferaft.SaveOptions(memory_budget=1 << 20))
    small = _process.PROCESS.ring
    assert small is not None and small.capacity <= (1 << 20) and small.high_water <= small.capacity
    # after an async save, the sync path reuses its (already faulted-in) pool
    save_with("async-blocking", str(tmp_path / "c"), state)
    pool = _process.PROCESS.pool
    liferaft.save(str(tmp_path / "d"), state)
    assert _process.PROCESS.pool is pool and _process.PROCESS.ring is small
    for p in "abcd":
        assert torch.equal(liferaft.read(str(tmp_path / p))["w"], state["w"])


@pytest.mark.parametrize("mode", MODES)
def test_strided_rows_larger_than_the_budget_are_split(tmp_path, mode):
    g = torch.Generator().manual_seed(1)
    state = {"t": torch.randn(300_000, 4, generator=g).t(),          # rows of 1.2 MB, not contiguous
             "u": torch.randn(3, 2, 200_000, generator=g).transpose(0, 1)}
    assert not state["t"].is_contiguous() and not state["u"].is_contiguous()
    save_with(mode, str(tmp_path / "ck"), state, memory_budget=1 << 20)
    got = liferaft.read(str(tmp_path / "ck"))
    assert torch.equal(got["t"], state["t"]) and torch.equal(got["u"], state["u"])


_MANY_SMALL = """
import sys, torch, liferaft
from saving import save_with
g = torch.Generator().manual_seed(2)
state = {f"k{i}": torch.randn(1 + (i * 37) % 300, generator=g) for i in range(2000)}
state.update({f"big{i}": torch.randn(300_000 + i, generator=g) for i in range(3)})
state.update({f"z{i}": torch.randn(1 + i % 50, generator=g) for i in range(2000)})
save_with(sys.argv[1], sys.argv[2], state, memory_budget=1 << 20)
got = liferaft.read(sys.argv[2])
assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
print("exact")
"""


@pytest.mark.parametrize("mode", MODES)
def test_many_small_tensors_in_batches_through_a_pool_smaller_than_the_state(tmp_path, mode):
    """Small pieces reach the writer in batches: a batch in the making is handed over before the stager waits
    for room (else the writer, holding none of it, would never free any): 2,000 tensors of 1-300 floats, then
    tensors whose pieces take the whole 1 MiB pool, then more small ones; every value exact. (In a process of its
    own: a stager waiting for room that only its batch holds fails the test at the timeout instead of hanging
    the suite.)"""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _MANY_SMALL, mode, str(tmp_path / "ck")], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))})
    assert out.returncode == 0 and "exact" in out.stdout, out.stderr[-3000:]


def test_a_snapshot_failure_raised_by_wait_staged_is_not_reported_again_by_the_next_save(tmp_path, monkeypatch):
    """``wait_staged()`` raising the snapshot's error tells the caller the save failed: the next save runs (it
    used to fail with "the previous async save ... failed and nobody waited for it")."""
    from liferaft.staging import stager

    real, calls = stager._copy, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected copy failure")
        return real(*a, **k)

    monkeypatch.setattr(stager, "_copy", failing)
    state = {f"k{i}": torch.full((10,), float(i)) for i in range(8)}
    handle = liferaft.async_save(str(tmp_path / "a"), state, options=liferaft.SaveOptions(staging="overlapped"))
    with pytest.raises(RuntimeError, match="injected"):
        handle.wait_staged()
    monkeypatch.setattr(stager, "_copy", real)
    liferaft.save(str(tmp_path / "b"), state)
    assert torch.equal(liferaft.read(str(tmp_path / "b"))["k7"], state["k7"])
    assert not os.path.exists(tmp_path / "a" / "COMMIT")


register_scheme("slowtest", GatedStorage)
register_scheme("failtest", FailingStorage)


@pytest.mark.parametrize("policy", ["wait", "skip", "raise"])
def test_second_save_while_one_is_in_flight(tmp_path, policy):
    GatedStorage.gate.clear()
    state = {"w": torch.ones(1000)}
    h = liferaft.async_save(f"slowtest://{tmp_path}/a", state)
    assert not h.done()
    opts = liferaft.SaveOptions(if_busy=policy)
    if policy == "wait":
        threading.Timer(0.5, GatedStorage.gate.set).start()
        h2 = liferaft.async_save(str(tmp_path / "b"), state, options=opts)   # waits for the first one
        assert h.done() and h2.wait().total_bytes == 4000
    elif policy == "skip":
        assert liferaft.async_save(str(tmp_path / "b"), state, options=opts) is None
        assert liferaft.save(str(tmp_path / "c"), state, options=opts) is None
    else:
        with pytest.raises(liferaft.CheckpointBusyError):
            liferaft.async_save(str(tmp_path / "b"), state, options=opts)
    GatedStorage.gate.set()
    h.wait()
    assert torch.equal(liferaft.read(str(tmp_path / "a"))["w"], state["w"])


def test_background_error_surfaces_on_wait_and_leaves_no_checkpoint(tmp_path):
    h = liferaft.async_save(f"failtest://{tmp_path}/ck", {"w": torch.ones(100)})
    with pytest.raises(liferaft.StorageError, match="No space left"):
        h.wait()
    with pytest.raises(liferaft.CheckpointNotFoundError):
        liferaft.read(str(tmp_path / "ck"))
    liferaft.save(str(tmp_path / "next"), {"w": torch.ones(1)})     # observed: the next save is not blocked


def test_unobserved_background_error_is_raised_at_the_next_save(tmp_path):
    h = liferaft.async_save(f"failtest://{tmp_path}/ck", {"w": torch.ones(100)})
    while not h.done():
        time.sleep(0.01)
    with pytest.raises(liferaft.LiferaftError, match="previous async save .* failed"):
        liferaft.save(str(tmp_path / "next"), {"w": torch.ones(1)})
    liferaft.save(str(tmp_path / "next"), {"w": torch.ones(1)})     # reported once


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_save_leaves_the_pool_usable(tmp_path, mode):
    """A write error stops the snapshot midway; the next save through the same (kept) pool must work."""
    state = {f"t{i}": torch.randn(256, 1024) for i in range(12)}        # 12 MiB: many pieces
    with pytest.raises(liferaft.StorageError):
        save_with(mode, f"failtest://{tmp_path}/bad", state)
    save_with(mode, str(tmp_path / "good"), state)
    got = liferaft.read(str(tmp_path / "good"))
    assert all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("huge", [False, True], ids=["ring of 4 KiB pages", "ring of huge pages"])
def test_a_sync_save_writes_large_host_tensors_uncopied_or_through_a_huge_ring_the_same_bytes(tmp_path, huge, monkeypatch):
    """Through a ring of 4 KiB pages, a synchronous save hands a large contiguous host tensor lying 64 bytes into a
    page (as torch's CPU allocator gives large ones out, and as its file range lies: save_plan.place) to storage
    from its own memory: the ring is not touched. A tensor elsewhere in a page (a view at an odd offset) goes
    through the ring. Through a ring of huge pages (``BufferPool.huge``) every tensor is copied into it (a request
    from its 2 MiB pages reaches the device in larger pieces). Either way the data file holds the same bytes as a
    save that copies everything (async), and loads bit for bit."""
    monkeypatch.setattr(pool_module, "huge_pages_offered", lambda: huge)
    _process.PROCESS.pool = _process.PROCESS.ring = None
    big = _at_phase(4 << 20, 64)                    # 16 MiB, 64 bytes into a page (as a fresh large allocation)
    liferaft.save(str(tmp_path / "a"), {"w": big})
    ring = _process.PROCESS.ring
    assert ring is not None and ring.huge is huge
    assert (ring.high_water > 0) is huge            # (copied, or uncopied)
    odd = _at_phase(4 << 20, 128)                   # (elsewhere in a page: a heap block, a view at an offset)
    liferaft.save(str(tmp_path / "b"), {"w": big, "v": odd})
    assert _process.PROCESS.ring.high_water >= odd.numel() * 4
    save_with("async-blocking", str(tmp_path / "c"), {"w": big, "v": odd})
    files = [sorted(p.read_bytes() for p in (tmp_path / d).rglob("*.bin")) for d in ("b", "c")]
    assert files[0] == files[1]
    from liferaft.core.commit import open_checkpoint
    from liferaft.storage import resolve

    manifest = open_checkpoint(resolve(str(tmp_path / "b")))
    assert all(c.byte_offset % 4096 == 64 for t in manifest.tensors for c in t.chunks)
    got = liferaft.read(str(tmp_path / "b"))
    assert torch.equal(got["w"], big) and torch.equal(got["v"], odd)


def _at_phase(numel: int, phase: int) -> torch.Tensor:
    """A contiguous float32 tensor of ``numel`` random values lying ``phase`` bytes into a page (whatever the
    allocator gave: a large tensor is one cache line into a page when mmap-ed, anywhere when carved from the heap)."""
    buf = torch.empty(numel + 2048)
    skip = ((phase - buf.data_ptr()) % 4096) // 4
    t = buf[skip:skip + numel]
    t.copy_(torch.randn(numel))
    assert t.data_ptr() % 4096 == phase and t.is_contiguous()
    return t



def test_encoded_runs_a_little_longer_than_the_scratch_buffer_are_written(tmp_path):
    """Encoded frames go through a page-aligned scratch copy, placed as their file range lies within a page: a run
    up to a page longer than the one the buffer was sized for is written whole (helper-117: a raw ValueError)."""
    from liferaft.core.chunks.writer import _File
    from liferaft.storage import PosixStorage

    f = _File(PosixStorage(str(tmp_path)), "x.bin", 64)
    n1 = 1 << 20
    p1 = f.start(n1)
    f.put_frames([b"a" * n1], p1, n1)
    n2 = n1 + 4090
    p2 = f.start(n2)
    f.put_frames([b"b" * (n2 - 10), b"c" * 10], p2, n2)
    f.w.close()
    data = (tmp_path / "x.bin").read_bytes()
    assert data[p1:p1 + n1] == b"a" * n1 and data[p2:p2 + n2] == b"b" * (n2 - 10) + b"c" * 10


@pytest.mark.parametrize("mode", ["sync", "async-blocking"])
def test_a_chunk_as_large_as_the_pool_is_still_held_whole(tmp_path, mode):
    """memory_budget equal to a chunk: the chunk is held whole in the pool (its pieces start 64 bytes into a page,
    as the pool's own buffer does), so a compressed save compresses it on every path alike (helper-117: stored raw
    by every path, and by a sync save where an async one compressed it)."""
    w = torch.zeros(4 << 20)                        # 16 MiB, very compressible
    w[::97] = 1.0
    res = save_with(mode, str(tmp_path / "ck"), {"w": w}, memory_budget=16 << 20, compression="on")
    assert res.bytes_written < (8 << 20)
    assert torch.equal(liferaft.read(str(tmp_path / "ck"))["w"], w)


@pytest.mark.parametrize("alignment", [64, 4096])
@pytest.mark.parametrize("mode", ["sync", "async-blocking"])
def test_large_chunks_go_to_storage_with_o_direct_whatever_the_alignment(tmp_path, mode, alignment):
    """The whole pages of a large chunk are written with O_DIRECT, from the tensor (sync) or the pool, whether
    chunks start 64 bytes into a page (alignment 64) or on a page (a larger alignment: helper-118, every byte went
    through the page cache since the pool's buffer lay 64 bytes into a page)."""
    from liferaft.storage import PosixStorage
    from liferaft.storage import posix as _posix

    sent = [0]
    real = _posix._PosixWriter._write_direct

    def counted(self, mv, offset):
        done = real(self, mv, offset)
        sent[0] += done
        return done

    _posix._PosixWriter._write_direct = counted
    try:
        w = _at_phase(4 << 20, 64 if alignment == 64 else 0)            # 16 MiB
        store = PosixStorage(str(tmp_path / "ck"), direct_io=True, inflight=1)
        if not _posix._PosixWriter(str(tmp_path / "probe"), direct=True)._direct_fd():
            pytest.skip("this file system refuses O_DIRECT")
        save_with(mode, store, {"w": w}, alignment=alignment)
    finally:
        _posix._PosixWriter._write_direct = real
    assert sent[0] >= 0.99 * (16 << 20), sent[0]         # (a piece's partial first and last pages: the cache)
    assert torch.equal(liferaft.read(str(tmp_path / "ck"))["w"], w)
