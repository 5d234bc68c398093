"""Incremental saves planned by each rank on its own (issue #20): rank 0 opens the base's index, each rank reads
only its own chunk table of the base, and the new chunk tables reference the base's files (format version 6).
On real ranks (gloo): the path is taken, unchanged chunks are referenced or (crumbs) copied, chains name the
checkpoint that holds the bytes, loads are exact on any layout, and a base of another layout or with a damaged
table costs only bytes written."""

from __future__ import annotations

import json
import os

import torch
from multiproc._own_incremental_ranks import (
    load_check,
    manager_run,
    save_chain,
    save_full,
    save_on,
    save_two,
    tensors_at,
)

import liferaft
from liferaft.testing import run_ranks


def _whole(path: str, frozen_rows: int) -> bool:
    want = tensors_at(1, frozen_rows)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    got["step"] = -1
    liferaft.load(path, got)
    return all(torch.equal(got[k], want[k]) for k in want) and got["step"] == 1


def test_unchanged_chunks_are_referenced_from_the_bases_table_of_each_rank(tmp_path):
    out = run_ranks(save_two, 2, str(tmp_path), 256)       # frozen: a third of the bytes
    for r in out:
        assert r["own"] and r["version"] == 6, r
        assert any(f.startswith("../a/data/") for f in r["table_files"]), r
        assert any(f.startswith("../a/data/") for f in r["index_files"]), r
        assert not any(f.endswith("-copies.bin") for f in r["index_files"]), r
    assert out[0]["reused"] >= 128 << 10 and out[1]["reused"] >= 128 << 10, out   # each rank's frozen rows
    path = str(tmp_path / "b")
    assert run_ranks(load_check, 2, path, 1, 256) == [True, True]
    assert run_ranks(load_check, 4, path, 1, 256, (2, 2)) == [True] * 4           # another layout
    assert _whole(path, 256)
    report = liferaft.verify(path)
    assert report.chunks > 0 and report.bytes_checked > 0


def test_crumbs_are_copied_into_the_save_and_its_base_can_go(tmp_path):
    out = run_ranks(save_two, 2, str(tmp_path), 16)        # frozen: 16 KiB of 528 KiB, under the 10 % share
    for r in out:
        assert r["own"] and r["version"] == 6, r
        assert not any(f.startswith("../") for f in r["index_files"] + r["table_files"] + r["inline_files"]), r
        assert any(f.endswith("-copies.bin") for f in r["table_files"]), r
    import shutil
    shutil.rmtree(tmp_path / "a")
    assert run_ranks(load_check, 2, str(tmp_path / "b"), 1, 16) == [True, True]
    assert liferaft.verify(str(tmp_path / "b")).chunks > 0


def test_a_chain_names_the_checkpoint_that_holds_the_bytes(tmp_path):
    for files in run_ranks(save_chain, 2, str(tmp_path), 256):
        assert any(f.startswith("../a/data/") for f in files), files       # frozen: still step 0's bytes
        assert not any(f.startswith("../b/") for f in files), files         # w changed at every step
    want = tensors_at(2, 256)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    got["step"] = -1
    liferaft.load(str(tmp_path / "c"), got)
    assert all(torch.equal(got[k], want[k]) for k in want) and got["step"] == 2


def test_an_xor_delta_save_is_planned_gathered_on_a_base_with_chunk_tables(tmp_path):
    run_ranks(save_full, 2, str(tmp_path / "a"), 0, 256)
    out = run_ranks(save_on, 2, str(tmp_path), "a", 1, 256, True)
    assert all(not r["own"] and r["reused"] >= 128 << 10 and not r["warnings"] for r in out), out
    assert run_ranks(load_check, 2, str(tmp_path / "b"), 1, 256) == [True, True]


def test_a_base_saved_on_another_layout_costs_only_bytes(tmp_path):
    run_ranks(save_full, 4, str(tmp_path / "a"), 0, 256, (2, 2))
    out = run_ranks(save_on, 2, str(tmp_path), "a", 1, 256)
    assert all(r["reused"] < 64 << 10 for r in out), out       # (no box of a sharded tensor is the base's)
    assert run_ranks(load_check, 2, str(tmp_path / "b"), 1, 256) == [True, True]


def test_a_damaged_table_of_the_base_is_written_again_by_its_rank_alone(tmp_path):
    run_ranks(save_full, 2, str(tmp_path / "a"), 0, 256)
    base = tmp_path / "a"
    marker = json.loads((base / "COMMIT").read_text())
    index = json.loads((base / marker["manifest"]).read_text())
    table = base / next(t["file"] for t in index["tables"] if t["rank"] == 1)
    raw = bytearray(table.read_bytes())
    raw[len(raw) // 2] ^= 1
    table.write_bytes(bytes(raw))
    out = run_ranks(save_on, 2, str(tmp_path), "a", 1, 256)
    assert out[0]["reused"] >= 128 << 10 and not out[0]["warnings"], out
    assert out[1]["reused"] < 64 << 10, out
    assert any("cannot be used" in w and "r00001-chunks.json" in w for w in out[1]["warnings"]), out
    assert run_ranks(load_check, 2, str(tmp_path / "b"), 1, 256) == [True, True]


def test_the_managers_default_incremental_saves_plan_on_each_rank(tmp_path):
    out = run_ranks(manager_run, 2, str(tmp_path / "run"), 256, timeout=240)
    for r in out:
        assert r["restored"] == 3 and r["exact"], r
        assert r["steps"] == {0: (), 2: (0,), 3: (0,)}, r              # frozen rows: step 0's bytes
        assert r["versions"] == {0: 4, 2: 6, 3: 6}, r
    assert os.path.isdir(tmp_path / "run" / "step-0000000000")


def test_pipeline_stages_save_asynchronously_on_a_base_planned_by_stages(tmp_path):
    from multiproc._own_incremental_ranks import save_stages_async, stage_tensors

    out = run_ranks(save_stages_async, 4, str(tmp_path), timeout=240)
    for r in out:
        assert r["staged"] and r["version"] == 6 and r["reused"] >= 64 << 10, r
        assert any(f.startswith("../a/data/") for f in r["files"]), r
    want = stage_tensors(0, 1) | stage_tensors(1, 1)
    got = {k: torch.zeros_like(v) for k, v in want.items()} | {"step": -1}
    liferaft.load(str(tmp_path / "b"), got)
    assert all(torch.equal(got[k], want[k]) for k in want) and got["step"] == 1


def test_the_index_rank_0_keeps_at_a_commit_is_what_its_bytes_decode_to(tmp_path):
    from multiproc._own_incremental_ranks import committed_index_is_decoded_index

    assert run_ranks(committed_index_is_decoded_index, 4, str(tmp_path), timeout=240)[0] == []


def test_a_base_holding_xor_deltas_is_written_again_not_listed_in_a_chunk_table(tmp_path):
    from multiproc._own_incremental_ranks import delta_then_plain

    assert all(r["version"] == 6 for r in run_ranks(delta_then_plain, 2, str(tmp_path)))
    assert run_ranks(load_check, 2, str(tmp_path / "c"), 1, 256) == [True, True]
    assert liferaft.verify(str(tmp_path / "c")).chunks > 0


def test_a_save_over_a_checkpoint_its_base_references_does_not_reference_itself(tmp_path):
    from multiproc._own_incremental_ranks import overwrite_on_a_base_referencing_it

    run_ranks(overwrite_on_a_base_referencing_it, 2, str(tmp_path))
    index = json.loads((tmp_path / "b" / json.loads((tmp_path / "b" / "COMMIT").read_text())["manifest"]).read_text())
    assert not any(f.startswith("../b/") for f in index["files"]), index["files"]
    assert run_ranks(load_check, 2, str(tmp_path / "b"), 1, 256) == [True, True]


def _reseal(path, edit) -> None:
    """Edit the index of checkpoint ``path`` (its JSON) and make its marker pin it again."""
    from liferaft.codecs.checksum import digest

    marker = json.loads((path / "COMMIT").read_text())
    doc = json.loads((path / marker["manifest"]).read_text())
    edit(doc)
    data = json.dumps(doc, separators=(",", ":")).encode()
    (path / marker["manifest"]).write_bytes(data)
    marker.update(manifest_size=len(data), manifest_hash=digest(data))
    (path / "COMMIT").write_text(json.dumps(marker))


def _retable(path, doc, rank, edit) -> None:
    from liferaft.codecs.checksum import digest

    ref = next(t for t in doc["tables"] if t["rank"] == rank)
    table = json.loads((path / ref["file"]).read_text())
    edit(table)
    data = json.dumps(table, separators=(",", ":")).encode()
    (path / ref["file"]).write_bytes(data)
    ref["hash"], ref["chunks"] = digest(data), len(table["chunks"])
    doc["files"][ref["file"]] = len(data)


def test_a_base_table_listing_a_chunk_twice_is_not_used_and_its_rank_writes_again(tmp_path):
    run_ranks(save_full, 2, str(tmp_path / "a"), 0, 256)

    def twice(table):
        first = next(c for c in table["chunks"] if c[1]["offsets"][0] == 128)   # (frozen's rows of rank 1)
        table["chunks"].append([first[0], {**first[1], "byte_offset": 0}])
    _reseal(tmp_path / "a", lambda doc: _retable(tmp_path / "a", doc, 1, twice))
    out = run_ranks(save_on, 2, str(tmp_path), "a", 1, 256)
    assert not out[0]["warnings"] and out[0]["reused"] >= 128 << 10, out
    assert any("listed twice" in w for w in out[1]["warnings"]) and out[1]["reused"] < 64 << 10, out
    assert run_ranks(load_check, 2, str(tmp_path / "b"), 1, 256) == [True, True]


def test_a_table_naming_its_own_checkpoint_as_a_sibling_is_refused(tmp_path):
    import shutil

    from golden.make_golden_v6 import GOLDEN_DIR

    shutil.copytree(GOLDEN_DIR, tmp_path / "v6")
    path = tmp_path / "v6" / "s2"

    def through_itself(doc):        # rank 1's frozen chunk named as rank 0's file, through "../s2/"
        own = next(f for f in doc["files"] if f.endswith("r00000.bin") and not f.startswith("../"))
        doc["files"][f"../s2/{own}"] = doc["files"][own]
        _retable(path, doc, 1, lambda t: t["chunks"][1][1].update(file=f"../s2/{own}"))
    _reseal(path, through_itself)
    for op in (liferaft.verify, liferaft.read, liferaft.inspect):
        try:
            op(str(path))
        except liferaft.UnsafePathError as e:
            assert "this checkpoint itself" in str(e)
        else:
            raise AssertionError(f"{op.__name__} accepted a table naming its own checkpoint as a sibling")
