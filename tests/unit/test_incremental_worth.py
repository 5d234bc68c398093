"""Incremental saves reference a base only where that saves a worthwhile share of the bytes (issue #14, item 6).

A step that would reference only crumbs of an older step (a few frozen or gradient-less chunks of a model that
otherwise changes every step) copies those crumbs into itself instead, so it does not keep the old step alive:
retention then frees what ``keep_last`` asks. A mostly frozen model still references its base."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import liferaft
from liferaft import CheckpointManager, SaveOptions


def crumbs_state():
    """A model that trains as a whole (~12 MB of weights and AdamW moments) next to a 66 KB frozen part (0.5 %):
    like BERT's pooler or the embeddings of tokens never seen, a few chunks stay the same between saves."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    frozen = torch.nn.Linear(64, 256)
    for p in frozen.parameters():
        p.requires_grad_(False)
    return {"model": model, "frozen": frozen, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3),
            "step": 0}


def mostly_frozen_state():
    """A frozen 8 MiB base and a small trainable head with AdamW (fine-tuning)."""
    torch.manual_seed(0)
    frozen = torch.nn.Linear(1024, 2048)
    for p in frozen.parameters():
        p.requires_grad_(False)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 16))
    return {"model": model, "frozen": frozen, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "step": 0}


def train(state, step):
    """One AdamW step of ``state["model"]`` (``state["frozen"]`` gets no gradient)."""
    x = torch.randn(4, state["model"][0].in_features, generator=torch.Generator().manual_seed(step))
    state["model"](x).pow(2).mean().backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["step"] = step + 1


def snapshot(state):
    """Every tensor and value of ``state``, as plain copies, for a bit-exact comparison."""
    out = {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
           "frozen": {k: v.clone() for k, v in state["frozen"].state_dict().items()}, "step": state["step"]}
    osd = state["optim"].state_dict()
    out["optim"] = {(i, k): v.clone() if isinstance(v, torch.Tensor) else v
                    for i, s in osd["state"].items() for k, v in s.items()}
    return out


def assert_bit_exact(a, b):
    assert a.keys() == b.keys()
    for part in ("model", "frozen", "optim"):
        assert a[part].keys() == b[part].keys(), part
        for k, v in a[part].items():
            w = b[part][k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and torch.equal(v.view(-1).view(torch.uint8), w.view(-1).view(torch.uint8)), k
            else:
                assert v == w, k
    assert a["step"] == b["step"]


def run(root, make, saves, **kw):
    state = make()
    with CheckpointManager(root, every_steps=1, keep_last=2, async_save=kw.pop("async_save", False), **kw) as mgr:
        for step in range(saves):
            train(state, step)
            mgr.maybe_save(step, state)
    with CheckpointManager(root) as mgr:            # (the first one's deletions have finished at its close)
        info = {i.step: i for i in mgr.steps()}
    return state, info


def manifest_files(step_dir):
    marker = json.load(open(os.path.join(step_dir, "COMMIT")))
    return json.load(open(os.path.join(step_dir, marker["manifest"])))["files"]


@pytest.mark.parametrize("async_save", [False, True])
def test_crumbs_of_a_full_step_are_copied_not_referenced_so_keep_last_is_honoured(tmp_path, async_save):
    root = str(tmp_path / "run")
    state, info = run(root, crumbs_state, 6, async_save=async_save)
    assert sorted(info) == [4, 5], info             # keep_last=2: nothing else pinned
    assert all(i.status == "committed" and i.depends_on == () for i in info.values())
    for s in (4, 5):
        assert not any(f.startswith("../") for f in manifest_files(info[s].path))
        liferaft.verify(info[s].path)
    fresh = crumbs_state()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh) == 5
    assert_bit_exact(snapshot(fresh), snapshot(state))


def test_a_mostly_frozen_model_still_references_its_base(tmp_path):
    root = str(tmp_path / "run")
    state, info = run(root, mostly_frozen_state, 6)
    base_bytes = 2048 * 1024 * 4
    # 4 and 5 (keep_last) and 0, which they reference for the frozen base: worth keeping
    assert sorted(info) == [0, 4, 5] and info[4].depends_on == (0,) and info[5].depends_on == (0,)
    assert info[0].nbytes > base_bytes and info[5].nbytes < base_bytes // 20
    fresh = mostly_frozen_state()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh) == 5
    assert_bit_exact(snapshot(fresh), snapshot(state))


def test_save_copies_crumbs_into_the_new_checkpoint_which_then_outlives_its_base(tmp_path):
    state = crumbs_state()
    train(state, 0)
    liferaft.save(str(tmp_path / "a"), state)
    train(state, 1)
    r = liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a"))
    frozen_bytes = (64 * 256 + 256) * 4
    assert r.bytes_reused == 0 and r.bytes_written >= frozen_bytes
    assert not any(f.startswith("../") for f in manifest_files(str(tmp_path / "b")))
    shutil.rmtree(tmp_path / "a")
    liferaft.verify(str(tmp_path / "b"))
    fresh = crumbs_state()
    liferaft.load(str(tmp_path / "b"), fresh)
    assert_bit_exact(snapshot(fresh), snapshot(state))
    # reference_min_share=0: every unchanged chunk is referenced, however few (the behaviour before)
    train(state, 2)
    liferaft.save(str(tmp_path / "c"), state)
    train(state, 3)
    r = liferaft.save(str(tmp_path / "d"), state, options=SaveOptions(incremental_base="c", reference_min_share=0))
    assert r.bytes_reused == frozen_bytes
    assert {f.split("/")[1] for f in manifest_files(str(tmp_path / "d")) if f.startswith("../")} == {"c"}


def test_the_decision_is_per_source_step_on_all_ranks_chunks_and_spares_delta_bases():
    from types import SimpleNamespace as C

    from liferaft.planning.references import crumb_sources
    from liferaft.planning.save_plan import WriteItem

    def w(n):
        return WriteItem(key="k", offsets=(0,), sizes=(n,), file="data/x/r00000.bin", byte_offset=0, length=n)

    own, s0, s1, s2 = "data/x/r00000.bin", "../s0/data/a/r00000.bin", "../s1/data/b/r00001.bin", "../s2/d/r.bin"
    writes = [[w(50), w(5)], [w(40), w(5)]]
    stored = [[C(file=own, delta=None), C(file=s0, delta=None)],      # rank 0: 5 of its 55 bytes from s0
              [C(file=s1, delta=None), C(file=s0, delta=None)]]      # rank 1: 40 from s1, 5 from s0
    assert crumb_sources(writes, stored, 0.1) == set()                # s0 gives 10 of 100 bytes: not below 10 %
    assert crumb_sources(writes, stored, 0.11) == {"s0"} and crumb_sources(writes, stored, 0.0) == set()
    assert crumb_sources(writes, stored, 0.5) == {"s0", "s1"}
    stored[0][0] = C(file=own, delta=C(file=s0))                      # an XOR delta against s0's bytes
    assert crumb_sources(writes, stored, 0.5) == {"s1"}
    stored[0][0] = C(file=own, delta=C(file=s2))
    assert crumb_sources(writes, stored, 0.5) == {"s0", "s1"}


def test_one_crumbs_rule_for_gathered_records_and_for_all_reduced_sums():
    """``crumbs_of`` is the rule both paths apply (gathered records; sums over the ranks in ``core.base``): a
    sibling referenced only by empty chunks is copied too (nothing of it is worth keeping it alive for)."""
    from types import SimpleNamespace as C

    from liferaft.planning.references import crumb_sources, crumbs_of
    from liferaft.planning.save_plan import WriteItem

    assert crumbs_of({"s0": 0, "s1": 9, "s2": 10}, 100, 0.1) == {"s0", "s1"}
    assert crumbs_of({"s0": 0, "s1": 9}, 100, 0.1, delta_bases={"s1"}) == {"s0"}
    assert crumbs_of({"s0": 1}, 0, 0.5) == set() and crumbs_of({"s0": 1}, 100, 0.0) == set()
    empty = WriteItem(key="e", offsets=(0,), sizes=(0,), file="data/x/r00000.bin", byte_offset=0, length=0)
    full = WriteItem(key="k", offsets=(0,), sizes=(8,), file="data/x/r00000.bin", byte_offset=0, length=8)
    stored = [[C(file="../s0/data/a/r00000.bin", delta=None), C(file="data/x/r00000.bin", delta=None)]]
    assert crumb_sources([[empty, full]], stored, 0.1) == {"s0"}


def test_selective_chunks_copied_still_say_which_step_they_come_from(tmp_path):
    layers = {f"layer{i}": torch.randn(256, 1024, generator=torch.Generator().manual_seed(i)) for i in range(20)}
    state = {"model": layers}
    liferaft.save(str(tmp_path / "a"), state)
    for k, v in layers.items():                     # layer1 (5 % of the bytes) barely changes; the rest does
        v.add_(torch.randn_like(v) * (1e-6 if k == "layer1" else 1e-1))
    liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a", selective=1e-3))
    assert not any(f.startswith("../") for f in manifest_files(str(tmp_path / "b")))
    marker = json.load(open(tmp_path / "b" / "COMMIT"))
    entries = {t["key"]: t for t in json.load(open(tmp_path / "b" / marker["manifest"]))["tensors"]}
    assert entries["model.layer1"]["lossy"]["from"] == ["a"]
    old = liferaft.read(str(tmp_path / "a"))["model"]["layer1"]
    shutil.rmtree(tmp_path / "a")
    got = {"model": {k: torch.zeros_like(v) for k, v in layers.items()}}
    with pytest.warns(UserWarning, match="taken from a"):
        liferaft.load(str(tmp_path / "b"), got)
    assert torch.equal(got["model"]["layer1"], old) and torch.equal(got["model"]["layer0"], layers["layer0"])


def test_a_damaged_crumb_is_not_copied_the_save_fails_naming_it(tmp_path):
    from liferaft.errors import CorruptCheckpointError

    state = {"big": torch.randn(1024, 1024), "crumb": torch.randn(1024)}
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="off"))
    marker = json.load(open(tmp_path / "a" / "COMMIT"))
    rec = next(t for t in json.load(open(tmp_path / "a" / marker["manifest"]))["tensors"]
               if t["key"] == "crumb")["chunks"][0]
    with open(tmp_path / "a" / rec["file"], "r+b") as f:
        f.seek(rec["byte_offset"] + 100)
        f.write(b"\xff\xff")
    state["big"] += 1
    with pytest.raises(CorruptCheckpointError, match=r"\.\./a/data.*'crumb'"):
        liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a", compression="off"))
    assert not os.path.exists(tmp_path / "b" / "COMMIT")
    assert not any(f.endswith(".bin") for _, _, fs in os.walk(tmp_path / "b") for f in fs)


def test_crumbs_are_copied_on_an_object_store_too(monkeypatch):
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    import uuid

    from liferaft.core.commit import open_checkpoint
    from liferaft.storage import resolve
    from liferaft.testing.s3server import MotoS3Server

    with MotoS3Server() as server:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        root = f"s3://{server.bucket}/{uuid.uuid4().hex[:10]}"
        state = crumbs_state()
        train(state, 0)
        liferaft.save(f"{root}/a", state)
        train(state, 1)
        r = liferaft.save(f"{root}/b", state, options=SaveOptions(incremental_base="a"))
        assert r.bytes_reused == 0
        files = open_checkpoint(resolve(f"{root}/b")).files
        assert any(f.endswith("-copies.bin") for f in files) and not any(f.startswith("../") for f in files)
        st = resolve(f"{root}/a")
        for name in st.list():
            st.delete(name)
        liferaft.verify(f"{root}/b")
        fresh = crumbs_state()
        liferaft.load(f"{root}/b", fresh)
        assert_bit_exact(snapshot(fresh), snapshot(state))
