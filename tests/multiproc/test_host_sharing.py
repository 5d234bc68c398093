"""Same-host shared-memory reads (``core.chunks.shm``): a span several ranks of a host need is read, decoded and
verified once, and the others copy from shared memory. Bitwise equal to plain per-rank reads for every layout
change; corrupt bytes fail every rank; a rank killed in the shared phase fails the others (no hang) and leaves
no segment behind."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

import pytest
import torch
from multiproc import _host_share_ranks as R

from liferaft.core.chunks import shm
from liferaft.testing import run_ranks
from liferaft.testing.launcher import RankFailure

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")


def _run(fn, world, *args):
    return run_ranks(fn, world, *args, timeout=240.0, pg_timeout=60.0)


CASES = [("S1", 2, "off"),          # Shard(0) -> Shard(1): every rank needs every row
         ("R", 2, "off"),           # -> Replicate
         ("S1", 3, "off"),          # 2 -> 3 ranks
         ("S0,S1", 4, "off"),       # FSDP (Shard(0)) -> FSDP x TP on a 2 x 2 mesh
         ("S1", 2, "on")]           # compressed chunks: decoded once


@pytest.mark.parametrize("layout,world,compression", CASES, ids=[f"{a}@{b}-{c}" for a, b, c in CASES])
def test_shared_memory_load_is_bitwise_equal_to_plain_reads(tmp_path, layout, world, compression):
    path = str(tmp_path / "ck")
    _run(R.save, 2, path, "S0", compression)
    out = _run(R.load_both, world, path, layout)
    assert all(o["same"] and o["right"] for o in out), out
    assert all(o["off_received"] == 0 for o in out), out
    assert sum(1 for o in out if o["received"] > 0) >= 2, f"nothing was shared: {out}"
    full = sum(R.reference(k).numel() * 4 for k in R.SHAPES)
    # every shared span read once on the host: less than every rank reading what it needs
    assert sum(o["read"] - o["received"] for o in out) < sum(o["read"] for o in out) <= world * full, out


def test_two_hosts_share_within_each_host_only(tmp_path):
    """The ranks of a host exchange their read spans among themselves (not with the whole job): on two simulated
    hosts of 2 ranks, each host reads every replicated byte once from storage and shares it within the host."""
    path = str(tmp_path / "ck")
    _run(R.save, 2, path, "S0", "off")
    out = _run(R.load_two_hosts, 4, path)
    assert all(o["right"] for o in out), out
    full = sum(R.reference(k).numel() * 4 for k in R.SHAPES)
    for host in (out[:2], out[2:]):
        assert all(o["read"] == full for o in host), out                    # each rank ends with all of it
        assert 0 < sum(o["received"] for o in host) < full * 2, out         # some of it came from its mate
        from_storage = sum(o["read"] - o["received"] for o in host)
        assert full <= from_storage <= full * 1.05, out      # read from storage about once, nothing from the other host


def test_rank_killed_in_the_shared_phase_fails_the_others_and_leaves_no_segment(tmp_path):
    path, pids = str(tmp_path / "ck"), tmp_path / "pids"
    pids.mkdir()
    _run(R.save, 2, path, "S0", "off")
    with pytest.raises(RankFailure) as failed:
        run_ranks(R.load_killed, 3, path, str(pids), 1, timeout=120.0, pg_timeout=60.0)
    assert "rank 0 ---" not in str(failed.value) and "rank 2 ---" not in str(failed.value), failed.value
    outcomes = {r: ast.literal_eval((pids / f"{r}.out").read_text()) for r in (0, 2)}
    assert not (pids / "1.out").exists(), "the victim finished its load before it was killed"
    for r, (kind, msg, seconds) in outcomes.items():
        assert kind == "DistributedError", outcomes
        assert seconds < 60.0, outcomes          # bounded by LoadOptions.timeout (10 s), not the test's
    for r in range(3):
        pid = (pids / f"{r}").read_text()
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"liferaft-load-{pid}-")]
        assert not left, f"rank {r} left {left}"


def test_stale_segments_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    name = f"liferaft-load-{dead}-{'0' * 16}-r0"
    young = f"liferaft-load-{dead}-{'1' * 16}-r0"           # its process may be in another PID namespace
    alive = shm.new_name(0)                                  # this process: left alone
    for n in (name, young, alive):
        with open(os.path.join(shm.SHM_DIR, n), "wb") as f:
            f.write(b"x")
    hour_ago = time.time() - 3700
    for n in (name, alive):
        os.utime(os.path.join(shm.SHM_DIR, n), (hour_ago, hour_ago))
    try:
        shm.sweep_stale()
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
        assert os.path.exists(os.path.join(shm.SHM_DIR, young))
        assert os.path.exists(os.path.join(shm.SHM_DIR, alive))
        shm.sweep_stale(min_age=0)
        assert not os.path.exists(os.path.join(shm.SHM_DIR, young))
    finally:
        for n in (name, young, alive):
            shm.unlink(n)


def test_a_segment_that_is_not_what_the_load_planned_is_refused(tmp_path):
    seg = shm.Segment.create(shm.new_name(0), 1 << 16, 2)
    try:
        from liferaft.errors import DistributedError
        with pytest.raises(DistributedError, match="regular file of this user"):
            shm.Segment.attach(seg.name, 1 << 16, 3, 0)       # another size than planned
        with pytest.raises(DistributedError, match="not one of liferaft's"):
            shm.Segment.attach("../etc/passwd", 1 << 16, 2, 0)
        for bad in [(seg.name, "65536", 2), (seg.name, 1 << 16, 2.0), (seg.name, True, 2), (None, 1 << 16, 2)]:
            with pytest.raises(DistributedError, match="not a name and two counts"):
                shm.Segment.attach(*bad, 0)                             # type: ignore[arg-type]
        peer = shm.Segment.attach(seg.name, 1 << 16, 2, 0)
        seg.slot(1, 8).copy_(torch.arange(8, dtype=torch.uint8))
        assert peer.slot(1, 8).tolist() == list(range(8))
        peer.close()
    finally:
        seg.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, seg.name))


def test_closing_in_the_background_drops_the_names_at_once_and_the_mappings_soon():
    own = shm.Segment.create(shm.new_name(0), 1 << 16, 2)
    peer = shm.Segment.attach(own.name, 1 << 16, 2, 0)
    own.slot(0, 4).fill_(7)
    share = shm.HostShare(own, {1: peer})
    share.close(background=True)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, own.name))    # the name: before close returns
    deadline = time.monotonic() + 10
    while (own._map is not None or peer._map is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert own._map is None and peer._map is None                      # the mappings: by the unmap thread


def test_a_fork_right_after_a_background_close_inherits_no_segment():
    # (a DataLoader forks its workers right after a load: they must not pin the load's shared memory)
    for _ in range(10):
        own = shm.Segment.create(shm.new_name(0), 32 << 20, 2)
        peer = shm.Segment.attach(own.name, 32 << 20, 2, 0)
        own.slot(1, 32 << 20).fill_(1)                                 # pages to free: the unmap takes a while
        name = own.name
        shm.HostShare(own, {1: peer}).close(background=True)
        pid = os.fork()
        if pid == 0:                                                    # the child: look, report, leave at once
            held = name in open("/proc/self/maps").read()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    held = held or name in os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    pass
            os._exit(3 if held else 0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child inherited the segment"
