"""The tools read a checkpoint's chunk tables by windows of keys (``Reader.read_order``; issue #20): ``diff`` and
the exports keep one window's chunk records at a time, not the whole checkpoint's, and give the same answers as
with every table read. Checkpoints saved by 2 real ranks (FSDP-style DTensors, chunk tables)."""

from __future__ import annotations

import pytest
import torch
from multiproc._windows_ranks import NAMES, save, tensors

import liferaft
from liferaft.core import native
from liferaft.core.open import open_reader
from liferaft.testing import run_ranks
from liferaft.tools._slabs import read_box


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    run_ranks(save, 2, str(root / "a"), 1)
    run_ranks(save, 2, str(root / "b"), 1, "layer3.weight")
    return root


def test_reads_in_order_hold_one_window_of_chunk_records(saved):
    reader = open_reader(str(saved / "a"), lazy=True)
    try:
        assert reader.read_order(NAMES, window_chunks=6)
        reader.check_present(NAMES)
        want = tensors(1)
        held = []
        for k in NAMES:
            shape = tuple(want[k].shape)
            got = read_box(reader, k, ((0,) * len(shape), shape))
            assert torch.equal(got, want[k]), k
            held.append(sum(len(reader.entries[x].chunks) for x in NAMES))
        assert reader.windows >= 3, reader.windows
        assert max(held) <= 6 + 4, held          # (a window: estimated 6 records, a key's own may exceed it)
    finally:
        reader.close()


def test_diff_and_exports_by_windows_answer_as_with_every_table_read(saved, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    whole = liferaft.diff(str(saved / "a"), str(saved / "b"))
    liferaft.convert(str(saved / "b"), str(tmp_path / "whole"), "safetensors")
    monkeypatch.setattr(native, "WINDOW_CHUNKS", 5)
    small = liferaft.diff(str(saved / "a"), str(saved / "b"))
    assert small.keys == whole.keys
    assert [k.key for k in small.keys if k.status != "equal"] == ["layer3.weight"]
    liferaft.convert(str(saved / "b"), str(tmp_path / "windowed"), "safetensors")
    liferaft.convert(str(saved / "b"), str(tmp_path / "b.pt"), "torch")
    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), \
        load_file(str(tmp_path / "windowed" / "model.safetensors"))
    want = tensors(1, "layer3.weight")
    assert a.keys() == b.keys() == set(NAMES) and all(torch.equal(b[k], want[k]) for k in NAMES)
    pt = torch.load(str(tmp_path / "b.pt"), weights_only=True)
    assert all(torch.equal(pt[k], want[k]) for k in NAMES)


def test_reads_across_windows_and_from_two_threads_are_exact(saved):
    """One read job holding keys of two windows keeps both; two threads reading keys of different windows (as
    the exports' prefetching does) each plan from the records they resolved."""
    import threading

    want = tensors(1)
    reader = open_reader(str(saved / "a"), lazy=True)
    try:
        assert reader.read_order(NAMES, window_chunks=2)
        boxes = [(k, ((0,) * want[k].dim(), tuple(want[k].shape))) for k in (NAMES[0], NAMES[-1])]
        outs = [torch.zeros_like(want[k]) for k, _ in boxes]
        reader.plan([(k, b, o) for (k, b), o in zip(boxes, outs)]).run()
        assert all(torch.equal(o, want[k]) for (k, _), o in zip(boxes, outs))
        assert reader.windows == 1          # (one window holding both keys: neither dropped for the other)
        errors: list[BaseException] = []

        def read(keys: list[str]) -> None:
            try:
                for _ in range(3):
                    for k in keys:
                        got = read_box(reader, k, ((0,) * want[k].dim(), tuple(want[k].shape)))
                        assert torch.equal(got, want[k]), k
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=read, args=(NAMES[i::2],)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert reader.windows > 4
    finally:
        reader.close()


def test_keys_not_announced_a_failed_window_and_unknown_keys_leave_every_read_exact(saved):
    """A read job of an announced key and one not announced holds both whole; a window whose table cannot be read
    leaves the window before as it was; unknown keys in the order do not shift the windows."""
    import json
    import os

    want = tensors(1)

    def whole(k):
        return ((0,) * want[k].dim(), tuple(want[k].shape))
    reader = open_reader(str(saved / "a"), lazy=True)
    try:
        assert reader.read_order(["nonesuch", *NAMES[:-1]], window_chunks=4)
        outs = [torch.full_like(want[k], -7.0) for k in (NAMES[0], NAMES[-1])]
        reader.plan([(k, whole(k), o) for k, o in zip((NAMES[0], NAMES[-1]), outs)]).run()
        assert torch.equal(outs[0], want[NAMES[0]]) and torch.equal(outs[1], want[NAMES[-1]])
        assert torch.equal(read_box(reader, NAMES[0], whole(NAMES[0])), want[NAMES[0]])
        index = json.loads(next((saved / "a").glob("manifest-*.json")).read_text())
        table = saved / "a" / index["tables"][1]["file"]
        os.rename(table, f"{table}.away")
        try:
            with pytest.raises(liferaft.CorruptCheckpointError, match="missing"):
                read_box(reader, NAMES[8], whole(NAMES[8]))
        finally:
            os.rename(f"{table}.away", table)
        assert torch.equal(read_box(reader, NAMES[1], whole(NAMES[1])), want[NAMES[1]])     # (still held)
        assert torch.equal(read_box(reader, NAMES[8], whole(NAMES[8])), want[NAMES[8]])
    finally:
        reader.close()
    reader = open_reader(str(saved / "a"), lazy=True)
    try:
        assert reader.read_order(["nonesuch", "other", *NAMES])     # (default window: one holds every key)
        for k in NAMES:
            assert torch.equal(read_box(reader, k, whole(k)), want[k]), k
        assert reader.windows == 1
    finally:
        reader.close()
