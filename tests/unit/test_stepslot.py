"""tiers.stepslot: a slot's holes (the held gradients of a thin replica) take no shared memory, and every byte
outside them stays allocated — on a real tmpfs (/dev/shm), measured by the file's allocated blocks."""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from liferaft.tiers import stepslot
from liferaft.tiers.stepslot import Slot, _intersect, _minus, _pages, _union

MIB = 1 << 20
PAGE = 4096


@pytest.fixture
def shm():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="liferaft-slot-")
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def _allocated(slot: Slot) -> int:
    return os.fstat(slot.fd).st_blocks * 512


def test_a_slot_with_holes_allocates_only_what_is_written_and_reads_zeros_there(shm):
    s = Slot(shm, "a")
    holes = [(1 * MIB + 100, 12 * MIB)]            # (not page-aligned: the whole pages inside stay holes)
    s.reserve(14 * MIB, whole=True, holes=holes)
    assert s.capacity >= 14 * MIB
    assert _allocated(s) <= s.capacity - 12 * MIB + 2 * PAGE
    s.write(0, b"\x11" * (1 * MIB + 100))           # outside the holes: allocated, written
    s.write(13 * MIB + 100, b"\x22" * (MIB - 100))
    assert _allocated(s) <= s.capacity - 12 * MIB + 2 * PAGE     # writing there touched no hole
    with open(s.path, "rb") as f:
        data = f.read(14 * MIB)
    assert data[:MIB + 100] == b"\x11" * (MIB + 100) and data[13 * MIB + 100:] == b"\x22" * (MIB - 100)
    assert data[MIB + 100:13 * MIB + 100] == bytes(12 * MIB)
    s.close()


def test_a_whole_record_after_a_thin_one_finds_every_page_allocated_and_a_thin_one_gives_them_back(shm):
    s = Slot(shm, "b")
    s.reserve(16 * MIB, whole=True, holes=[(2 * MIB, 12 * MIB)])
    thin = _allocated(s)
    s.reserve(16 * MIB, whole=True)                 # a whole record next: nothing may stay a hole
    assert s.sparse == [] and _allocated(s) >= s.capacity
    s.write(0, b"\x33" * (16 * MIB))
    s.reserve(16 * MIB, whole=True, holes=[(2 * MIB, 12 * MIB)])
    assert _allocated(s) >= s.capacity              # reserved with holes: nothing freed yet (the old record)
    s.punch([(2 * MIB, 12 * MIB)])
    assert _allocated(s) == thin and s.sparse == [(2 * MIB, 12 * MIB)]
    with open(s.path, "rb") as f:
        f.seek(2 * MIB)
        assert f.read(12 * MIB) == bytes(12 * MIB)
    s.reserve(20 * MIB, whole=True, holes=[(2 * MIB, 12 * MIB)])       # grown, the holes kept
    assert _allocated(s) <= s.capacity - 12 * MIB and s.capacity >= 20 * MIB
    s.reserve(s.capacity + 1)                       # grown without holes: all allocated again
    assert s.sparse == [] and _allocated(s) >= s.capacity
    s.close()


def test_a_full_shm_fails_the_reservation_not_the_write(shm, monkeypatch):
    s = Slot(shm, "c")
    s.reserve(4 * MIB, whole=True, holes=[(MIB, 2 * MIB)])
    calls = []

    def full(fd: int, off: int, n: int) -> None:
        calls.append((off, n))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stepslot.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="cannot reserve"):
        s.reserve(4 * MIB, whole=True)              # the hole must be allocated before a whole record
    assert calls and s.sparse == [(MIB, 2 * MIB)]   # still known as a hole: the next reserve tries again
    s.close()


def test_many_held_runs_are_kept_allocated():
    holes = [(i * 3 * PAGE, 2 * PAGE) for i in range(stepslot._MAX_HOLES + 1)]
    assert _pages(holes) == []
    assert _pages(holes[:3]) == [(0, 2 * PAGE), (3 * PAGE, 2 * PAGE), (6 * PAGE, 2 * PAGE)]
    assert _pages([(1, PAGE)]) == [] and _pages([(1, 2 * PAGE)]) == [(PAGE, PAGE)]


ranges = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), max_size=6)


def _set(rs: list[tuple[int, int]]) -> set[int]:
    return {x for off, n in rs for x in range(off, off + n)}


@given(ranges, ranges)
def test_range_arithmetic_matches_sets(a, b):
    u, i, m = _union(a, b), _intersect(a, b), _minus(a, b)
    assert _set(u) == _set(a) | _set(b) and _set(i) == _set(a) & _set(b) and _set(m) == _set(a) - _set(b)
    for rs in (u, i):                               # sorted, merged, no empty range
        assert all(n > 0 for _, n in rs) and all(x[0] + x[1] < y[0] for x, y in itertools.pairwise(rs))


def test_a_hole_reaching_past_the_reservation_still_maps_the_whole_slot(shm):
    s = Slot(shm, "d")
    s.reserve(8192, whole=True, holes=[(4096, 1 << 20)])     # (a hole running past size and the slack)
    assert s.map is not None and os.fstat(s.fd).st_size == s.capacity >= 8192
    s.write(0, b"\x44" * 4096)
    assert _allocated(s) <= 2 * PAGE
    s.reserve(s.capacity)                           # no holes now: all allocated
    assert s.sparse == [] and _allocated(s) >= s.capacity
    s.close()
