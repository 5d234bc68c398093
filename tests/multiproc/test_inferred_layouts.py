"""Hand-made shards (``liferaft.Sharded``) and DTensors on a mesh of the ranks in another order, on 4 real ranks:
when every rank's box follows one DTensor-like layout, the save infers it from a few ranks' boxes
(``planning.layouts.infer_layout``; every rank checks its own box), each rank plans its own writes and the save
commits with chunk tables; a repeated save reuses what was inferred; boxes that follow no layout, even when only a
rank that was not probed strays, are saved through the gathered plan and committed with chunk tables whose index
lists every chunk's box and rank (explicit boxes). Every checkpoint loads exactly, whole and resharded onto 3
ranks."""

from __future__ import annotations

import torch
from multiproc._inferred_ranks import HANDMADE, IRREGULAR, full, load_rows, save, save_rotated, save_tables_differ

import liferaft
from liferaft.core.commit import open_checkpoint
from liferaft.storage import resolve
from liferaft.testing import run_ranks

PERMUTED = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def _expect(name: str) -> torch.Tensor:
    return PERMUTED if name in ("permuted", "rotated", "replicated_down", "sub_of_permuted") else full(name)


def _check_exact(path: str, names: tuple[str, ...]) -> None:
    whole = {n: torch.zeros_like(_expect(n)) for n in names}
    liferaft.load(path, whole, options=liferaft.LoadOptions(ignore_keys=("plain", "step")))
    for n in names:
        assert torch.equal(whole[n], _expect(n)), n
    for rank, got in enumerate(run_ranks(load_rows, 3, path, names)):
        for n in names:
            rows = _expect(n).shape[0]
            lo, hi = rank * rows // 3, (rank + 1) * rows // 3
            assert got[n] == _expect(n)[lo:hi].tolist(), (n, rank)


def test_hand_made_shards_that_follow_a_layout_are_planned_by_each_rank(tmp_path):
    names = (*HANDMADE, "permuted", "replicated_down")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for kinds, inferred in run_ranks(save, 4, [a, b], names):     # (the plain tensor changed between the saves:
        assert kinds == ["layouts", "layouts"] and inferred == 1    # the inferred layouts are kept all the same)
    m = open_checkpoint(resolve(a))
    assert m.version == 4 and m.tables
    layouts = {t.key: t.layout for t in m.tensors if t.layout is not None}
    assert layouts["tp_rows"][:2] == ((2, 2), (None, 0))
    assert layouts["dp_rows"][:2] == ((2, 2), (0, None))
    assert layouts["cols"][:2] == ((4,), (1,))
    assert layouts["grid"][:2] == ((2, 2), (0, 1))
    assert layouts["permuted"][:2] == ((2, 2), (1, 0))      # rank r holds row block r % 2, column block r // 2
    for t in m.tensors:                                     # every element stored exactly once
        assert sum(c.length for c in t.chunks) == torch.Size(t.shape).numel() * 4, t.key
    for path in (a, b):
        _check_exact(path, names)


def test_hand_made_shards_that_follow_no_layout_are_planned_gathered_and_indexed_by_their_boxes(tmp_path):
    for name in IRREGULAR:
        path = str(tmp_path / name)
        for kinds, _ in run_ranks(save, 4, [path], (name, "tp_rows")):
            assert kinds == ["gathered"], name
        m = open_checkpoint(resolve(path), tables=False)        # (the index: explicit boxes, chunks in tables)
        assert m.version == 4 and m.tables and all(t.boxes and not t.chunks for t in m.tensors), name
        boxes = next(t.boxes for t in m.tensors if t.key == name)
        assert {(o, z) for _, o, z in boxes} == {((r0, c0), (nr, nc)) for r0, nr, c0, nc in IRREGULAR[name][1]}
        _check_exact(path, (name, "tp_rows"))
        liferaft.verify(path)


def test_a_dtensor_on_a_sub_mesh_of_a_root_holding_the_ranks_out_of_order_loads_exactly(tmp_path):
    """A spec over the root mesh takes its ranks in row-major order; a root that holds them otherwise (rank 1 at
    dp 1) must not be described so (rank 1's rows would be stored as dp 0's): its boxes are inferred or gathered."""
    path = str(tmp_path / "sub")
    run_ranks(save, 4, [path], ("sub_of_permuted",))
    _check_exact(path, ("sub_of_permuted",))
    liferaft.verify(path)


def test_a_dtensor_on_a_mesh_whose_ranks_decrease_along_a_dimension_is_refused(tmp_path):
    """torch orders such a dimension's process group by rank number and its coordinates by position: the box a
    coordinate names is not the one the rank holds (a silent wrong checkpoint, as DCP writes it)."""
    path = str(tmp_path / "ck")
    for msg in run_ranks(save_rotated, 4, path):
        assert "key 'rotated'" in msg and "increasing order" in msg, msg
    assert not (tmp_path / "ck" / "COMMIT").exists()


def test_ranks_passing_different_chunk_tables_are_refused_alike(tmp_path):
    for names in ((*HANDMADE,), tuple(IRREGULAR)):          # (planned on each rank; planned gathered)
        path = str(tmp_path / names[0])
        for msg in run_ranks(save_tables_differ, 4, path, names):
            assert msg.startswith("InvalidStateError") and "chunk_tables" in msg, msg
        assert not (tmp_path / names[0] / "COMMIT").exists()
