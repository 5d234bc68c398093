"""Pipeline stages on 4 real ranks (2 stages × FSDP2 over 2 data-parallel ranks, AdamW): the ranks hold different
tensors, yet each plans its own writes (``planning.stages``: nothing but 8 bytes a rank is all-gathered), the save
commits with chunk tables whose layouts are scoped to their stage (``at``), a repeated save reuses the agreement,
and every checkpoint loads exactly: into the same layout, into 2 ranks of one stage each, into one process."""

from __future__ import annotations

import pytest
import torch
from multiproc._stages_ranks import LAYERS, STAGES, full_model, load, load_expect_error, save

import liferaft
from liferaft.core.commit import open_checkpoint
from liferaft.storage import resolve
from liferaft.testing import run_ranks
from liferaft.testing.tamper import rewrite_manifest


def _saved(tmp_path, n: int = 1) -> tuple[list[str], str]:
    paths, ref = [str(tmp_path / f"c{i}") for i in range(n)], str(tmp_path / "ref")
    for kinds in run_ranks(save, 4, paths, ref):     # planned by each rank, the agreement kept once and reused
        assert kinds == [("layouts", 1, "exchanged")] + [("layouts", 1, "reused")] * (n - 1)
    return paths, ref


def test_pipeline_stages_under_fsdp2_are_planned_by_each_rank_and_load_exactly(tmp_path):
    (a, b), ref = _saved(tmp_path, 2)
    m = open_checkpoint(resolve(a))
    assert m.version == 5 and len(m.tables) == 4
    layouts = {t.key: t.layout for t in m.tensors}
    for stage, names in enumerate(STAGES):
        for k in names:
            assert layouts[f"model.{k}.weight"] == ((2, 2), (None, 0), None, (stage, None))
            assert layouts[f"optim.state.{k}.weight.exp_avg"] == ((2, 2), (None, 0), None, (stage, None))
            assert layouts[f"optim.state.{k}.weight.step"] == ((4,), (None,), None, None)   # whole: in the index
    assert layouts["shared"][:2] == ((4,), (None,))
    for t in m.tensors:                                     # every element stored exactly once
        assert sum(c.length for c in t.chunks) == torch.Size(t.shape).numel() * 4, t.key
    for step, path in enumerate((a, b)):
        assert run_ranks(load, 4, path, ref, step, (2, 2)) == [[]] * 4
        assert run_ranks(load, 2, path, ref, step, (2, 1)) == [[]] * 2     # one rank per stage, whole
    assert liferaft.verify(a).chunks == sum(len(t.chunks) for t in m.tensors)


def test_every_stage_loads_into_one_process(tmp_path):
    (path,), ref = _saved(tmp_path)
    model = full_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    st = {"model": model, "optim": opt, "stage_state": {"s0": torch.zeros(5), "s1": torch.zeros(5)},
          "shared": torch.zeros(6), "step": -1}
    assert list(liferaft.load(path, st, strict=False).missing_keys) == ["optim.param_groups"]
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)["state"]
    for stage in (0, 1):
        want = torch.load(f"{ref}.0.{stage}")
        for k, t in want["model"].items():
            assert torch.equal(model.state_dict()[k], t), k
        for k, s in want["optim"].items():
            for n, t in s.items():
                assert torch.equal(osd[k][n], t), (k, n)
        assert torch.equal(st["stage_state"][f"s{stage}"], torch.full((5,), float(stage)))
    assert st["step"] == 0 and torch.equal(st["shared"], torch.arange(6.0))
    assert set(LAYERS) == set(model)


def test_an_index_whose_stage_is_moved_is_refused_by_name(tmp_path):
    (path,), ref = _saved(tmp_path)

    def move(doc):      # the first stage's layers said to be held by the second stage's ranks
        for t in doc["tensors"]:
            if t.get("layout", {}).get("at") == [0, None]:
                t["layout"]["at"] = [1, None]
    rewrite_manifest(path, move)
    for got in run_ranks(load_expect_error, 4, path, ref):     # (the ranks of the first stage find it)
        assert "CorruptCheckpointError" in got and "'model.l0.weight': the chunk tables cover 0 of" in got, got
    with pytest.raises(liferaft.CorruptCheckpointError, match="is not a piece of rank 0's box"):
        liferaft.verify(path)                               # (and verify, reading its tables)


def test_an_index_with_stages_that_says_version_4_is_refused(tmp_path):
    (path,), _ = _saved(tmp_path)
    rewrite_manifest(path, lambda doc: doc.update(version=4))
    with pytest.raises(liferaft.CorruptCheckpointError, match="at needs format version 5"):
        liferaft.inspect(path)


def test_stages_whose_plain_tensor_differs_on_one_rank_are_planned_gathered_and_keep_each_copy(tmp_path):
    from multiproc._stages_ranks import save_diverged

    got = run_ranks(save_diverged, 4, str(tmp_path / "c"))
    assert [k for k, _ in got] == ["gathered"] * 4
    assert [s for _, s in got] == [list(range(6))] * 3 + [[100.0 + i for i in range(6)]]


def test_an_async_save_of_stages_is_planned_by_each_rank_and_loads_exactly(tmp_path):
    from multiproc._stages_ranks import save_async

    path, ref = str(tmp_path / "c"), str(tmp_path / "ref")
    assert run_ranks(save_async, 4, path, ref) == ["layouts"] * 4
    assert open_checkpoint(resolve(path)).version == 5
    assert run_ranks(load, 4, path, ref, 0, (2, 2)) == [[]] * 4


@pytest.mark.parametrize("kind", ["tensor", "dict", "tensor-dict"])
def test_stages_whose_key_is_a_tensor_on_one_and_a_value_or_container_on_another_are_refused(tmp_path, kind):
    """Before anything is committed: the checkpoint already at the path stays, and loads."""
    from multiproc._stages_ranks import save_conflicting

    path = str(tmp_path / "c")
    liferaft.save(path, {"good": torch.arange(3.0)})
    for got in run_ranks(save_conflicting, 4, path, kind):
        assert got.startswith(("InvalidStateError", "DistributedError")) and "conflict" in got, got
    back = {"good": torch.zeros(3)}
    liferaft.load(path, back)
    assert torch.equal(back["good"], torch.arange(3.0))


def test_stages_passing_different_chunk_bytes_are_refused_by_name_before_writing(tmp_path):
    from multiproc._stages_ranks import save_options_differ

    path = tmp_path / "c"
    for got in run_ranks(save_options_differ, 4, str(path)):
        assert got.startswith("InvalidStateError") and "SaveOptions.chunk_bytes" in got, got
    assert not (path / "COMMIT").exists() and not list(path.rglob("*.bin"))


@pytest.mark.parametrize("own_key", [True, False])
def test_stages_that_name_their_layers_alike_are_refused_and_tied_weights_in_sync_save_exactly(tmp_path, own_key):
    """Two stages holding ``0.weight`` with their own values would be written as one tensor pieced from both
    (their boxes look like replicas): refused by name before anything is written, whether the stages also hold
    keys of their own (planned by stages) or not (every rank describes the same: planned as one layout). The
    same key with the same values on both stages (a tied weight kept in sync) saves and loads exactly."""
    from multiproc._stages_ranks import save_alike_names

    path = tmp_path / "alike"
    for got in run_ranks(save_alike_names, 4, str(path), False, own_key):
        assert got.startswith("InvalidStateError") and "'model.0.weight'" in got and "as replicas" in got, got
    assert not (path / "COMMIT").exists() and not list(path.rglob("*.bin"))
    tied = str(tmp_path / "tied")
    assert run_ranks(save_alike_names, 4, tied, True, own_key) == ["committed"] * 4
    torch.manual_seed(0)
    want = torch.nn.Sequential(torch.nn.Linear(64, 64))
    got = torch.nn.Sequential(torch.nn.Linear(64, 64))
    liferaft.load(tied, {"model": got, "stage0": torch.zeros(2), "stage1": torch.zeros(2)}, strict=own_key)
    assert all(torch.equal(a, b) for a, b in zip(want.state_dict().values(), got.state_dict().values()))


@pytest.mark.parametrize("how", ["incremental", "swapped halves"])
def test_stages_named_alike_are_refused_when_planned_gathered_and_when_their_rows_are_permuted(tmp_path, how):
    """An incremental save (planned on each rank, on a base) compares the copies too; and a stage holding the same rows in another
    order differs (each box's sample is hashed with its offsets: sums over the boxes cannot cancel)."""
    from multiproc._stages_ranks import save_alike_names

    path = tmp_path / "c"
    args = (False, False, str(tmp_path / "base"), False) if how == "incremental" else (False, True, None, True)
    for got in run_ranks(save_alike_names, 4, str(path), *args):
        assert got.startswith("InvalidStateError") and "'model.0.weight'" in got and "as replicas" in got, got
    assert not (path / "COMMIT").exists()


def test_batchnorm_statistics_differing_per_rank_are_not_compared(tmp_path):
    from multiproc._stages_ranks import save_batchnorm

    assert run_ranks(save_batchnorm, 4, str(tmp_path / "c")) == ["committed"] * 4


@pytest.mark.parametrize("how", ["strided", "switched"])
def test_stages_named_alike_are_refused_with_strided_shards_and_after_a_trusted_save(tmp_path, how):
    from multiproc._stages_ranks import save_strided_or_switched

    for first, second in run_ranks(save_strided_or_switched, 4, str(tmp_path), how):
        assert first == "committed"
        assert second.startswith("InvalidStateError") and "['w']" in second and "as replicas" in second, second
    assert not (tmp_path / "b" / "COMMIT").exists()
