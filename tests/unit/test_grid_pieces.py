"""Reads of part of a chunk are cut on the chunk's hash-block grid (``planning.load_plan._grid_pieces``).

A piece of a box is read as the whole blocks it spans; pieces cut anywhere share their first and last blocks with
their neighbours, which read them again: with 4 MiB blocks and 8 MiB reads, every block twice. Cut into windows
of whole blocks, the reads of a chunk's part never overlap, none is longer than the read size (or one block), and
the bytes come out exact, for any shape, dtype, block size and read size (a seeded sweep)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_planning import run_units, saved_entry, shard_boxes

from liferaft.planning import load_plan as lp

DTYPES = [torch.uint8, torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.int64]


def _case(rng: random.Random):
    dt = rng.choice(DTYPES)
    isz = torch.empty(0, dtype=dt).element_size()
    nd = rng.randint(1, 3)
    shape = tuple(rng.choice([1, 2, 3, 5, 8, 33, 64, 100, 257]) for _ in range(nd))
    if nd == 1:
        shape = (rng.choice([1, 7, 100, 1000, 5000, 40000]),)
    g = torch.randint(0, 2, shape, dtype=torch.uint8).bool() if dt == torch.bool else \
        torch.randn(shape, dtype=dt) if dt.is_complex else torch.randn(shape).to(dt) if dt.is_floating_point \
        else torch.randint(0, 255, shape).to(dt)
    bs = -(-rng.choice([16, 32, 48, 64, 96, 128, 256, 1024, 4096]) // isz) * isz
    max_read = rng.choice([bs, bs + 1, 2 * bs, 3 * bs - 1, 8 * bs, 4096, 100000])
    saved = shard_boxes(shape, tuple(rng.randint(1, 3) for _ in shape))
    wanted = [b for b in shard_boxes(shape, tuple(rng.randint(1, 4) for _ in shape)) if 0 not in b[1]]
    return dt, g, bs, max_read, saved, wanted


@pytest.mark.parametrize("seed", range(4))
def test_parts_of_chunks_read_each_block_once_exactly(seed):
    rng = random.Random(seed)
    for _ in range(60):
        dt, g, bs, max_read, saved, wanted = _case(rng)
        if g.numel() * g.element_size() > 4 << 20:
            continue
        entry, data = saved_entry(g, saved, bs)
        for box in wanted:
            units = lp.plan_reads(entry, [(0, box)], max_read)
            got, _ = run_units(units, data, [box], dt)
            assert torch.equal(got[0], g[tuple(slice(o, o + s) for o, s in zip(*box))]), (g.shape, bs, max_read, box)
            assert all(u.length <= max(max_read, bs) for u in units), (bs, max_read, [u.length for u in units])
            spans: dict[str, list[tuple[int, int]]] = {}
            for u in units:
                spans.setdefault(u.file, []).append((u.file_offset, u.file_offset + u.length))
            for file_spans in spans.values():
                file_spans.sort()
                assert all(a[1] <= b[0] for a, b in itertools.pairwise(file_spans)), (bs, max_read, file_spans)


def test_whole_rows_that_start_inside_a_large_block():
    # 96 rows of 4 KiB in 64 KiB blocks (16 rows each), rows 19..83 wanted, 128 KiB reads: blocks 1..5 each once
    g = torch.arange(96 * 1024, dtype=torch.float32).reshape(96, 1024)
    entry, data = saved_entry(g, [((0, 0), (96, 1024))], 64 << 10)
    box = ((19, 0), (64, 1024))
    units = lp.plan_reads(entry, [(0, box)], 128 << 10)
    got, nread = run_units(units, data, [box], torch.float32)
    assert torch.equal(got[0], g[19:83])
    assert nread == 5 * (64 << 10)                       # (blocks 1..5: rows 16..95; cut anywhere: 8 blocks)


def test_a_narrow_column_of_wide_rows_visits_only_the_windows_it_has_bytes_in(monkeypatch):
    # a 1-wide column of a (64, 2**16) fp32 chunk in 4 KiB blocks and reads: 64 blocks hold its bytes, among
    # 4096 windows of its span; each window was clipped (seconds of planning for larger chunks)
    g = torch.zeros(64, 1 << 16)
    entry, data = saved_entry(g, [((0, 0), (64, 1 << 16))], 4096)
    calls = []
    real = lp._clip
    monkeypatch.setattr(lp, "_clip", lambda *a: calls.append(1) or real(*a))
    units = lp.plan_reads(entry, [(0, ((0, 5), (64, 1)))], 4096)
    assert len(units) == 64 and sum(u.length for u in units) == 64 * 4096
    assert len(calls) <= 2 * 64
