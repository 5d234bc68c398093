"""Per-rank storage of plain tensors whose copies differ (issue 14, item 4), as pure planning in one process: the
digests every rank sends decide, the stored tensor gets a leading ranks dimension, each rank writes its row, and
the manifest says so (format version 3, docs/FORMAT.md §4.5)."""

from __future__ import annotations

import json

import pytest
import torch

from liferaft.core.chunks.writer import StoredChunk
from liferaft.core.phases import tensor_digest
from liferaft.errors import CorruptCheckpointError
from liferaft.format.manifest import decode_manifest
from liferaft.planning.save_plan import RankMeta, TensorMeta, build_manifest, per_rank_keys, plan_save


def meta(rank, digests, world, keys=("gen", "same", "sharded")):
    tensors = []
    for k in keys:
        if k == "sharded":      # a DTensor-like shard: never compared
            tensors.append(TensorMeta(key=k, path=(k,), kind="tensor", dtype="float32", shape=(2 * world,),
                                      boxes=(((2 * rank,), (2,)),)))
        else:
            tensors.append(TensorMeta(key=k, path=(k,), kind="tensor", dtype="uint8", shape=(16,),
                                      boxes=(((0,), (16,)),)))
    return RankMeta(rank=rank, tensors=tuple(tensors), values=(), containers=(), digests=tuple(digests))


def test_only_the_tensors_whose_copies_differ_are_stored_per_rank_by_4_ranks():
    metas = [meta(r, [("gen", f"g{r % 3}"), ("same", "s")], 4) for r in range(4)]
    assert per_rank_keys(metas) == {"gen": (0, 1, 2, 3)}
    plan = plan_save(metas, "id")
    by_key = {t.key: t for t in plan.tensors}
    assert by_key["gen"].per_rank == (0, 1, 2, 3) and by_key["gen"].shape == (4, 16)
    assert by_key["gen"].boxes == tuple(((r, 0), (1, 16)) for r in range(4))
    assert by_key["same"].per_rank is None and by_key["same"].shape == (16,)
    for r in range(4):                                  # each rank writes its own row
        rows = [w for w in plan.writes[r] if w.key == "gen"]
        assert [(w.offsets, w.sizes) for w in rows] == [((r, 0), (1, 16))]
    assert sum(w.key == "same" for ws in plan.writes for w in ws) == 1

    stored = [[StoredChunk(file=w.file, byte_offset=w.byte_offset, block_size=64, hashes=("0" * 16,))
               for w in ws] for ws in plan.writes]
    m = build_manifest(plan, stored, [max((w.byte_offset + w.length for w in ws), default=0) for ws in plan.writes], save_id="id",
                       created_unix=0.0, liferaft_version="x", torch_version="y")
    assert m.needs_version() == 3
    back = decode_manifest(m.to_json_bytes())
    assert back.version == 3 and back.tensor_map()["gen"].per_rank == (0, 1, 2, 3)
    assert back.tensor_map()["same"].per_rank is None


def test_a_key_held_by_some_ranks_only_is_stored_for_those():
    metas = [meta(0, [("gen", "a")], 3), meta(1, [], 3, keys=("same", "sharded")), meta(2, [("gen", "b")], 3)]
    plan = plan_save(metas, "id")
    gen = {t.key: t for t in plan.tensors}["gen"]
    assert gen.per_rank == (0, 2) and gen.shape == (2, 16)
    assert [w.offsets for w in plan.writes[2] if w.key == "gen"] == [(1, 0)]


def test_equal_copies_keep_the_old_layout():
    plan = plan_save([meta(r, [("gen", "g"), ("same", "s")], 3) for r in range(3)], "id")
    assert all(t.per_rank is None for t in plan.tensors)


def test_digest_is_of_the_bytes():
    a = torch.arange(10, dtype=torch.float32)
    assert tensor_digest(a) == tensor_digest(a.clone()) != tensor_digest(a + 1)
    assert tensor_digest(torch.tensor(3.5, dtype=torch.bfloat16)) != tensor_digest(torch.tensor(3.0,
                                                                                              dtype=torch.bfloat16))
    assert tensor_digest(torch.zeros(0)) == tensor_digest(torch.zeros(0))
    assert tensor_digest(a[::2]) == tensor_digest(a[::2].contiguous())


@pytest.mark.parametrize("per_rank, why", [([0], "one per index"), ([0, 0], "distinct"), ([0, 5], "rank 5")])
def test_a_bad_per_rank_field_is_refused(per_rank, why):
    doc = {"format": "liferaft", "version": 3, "save_id": "id", "world_size": 2, "created_unix": 0.0,
           "checksum": "xxh3_64", "byte_order": "little", "files": {}, "values": [], "containers": [],
           "tensors": [{"key": "g", "path": ["g"], "kind": "tensor", "dtype": "uint8", "shape": [2, 0],
                        "chunks": [], "per_rank": per_rank}]}
    with pytest.raises(CorruptCheckpointError, match=why):
        decode_manifest(json.dumps(doc).encode())
