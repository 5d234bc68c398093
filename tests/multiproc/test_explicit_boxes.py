"""Version 4 indexes with explicit boxes (docs/FORMAT.md §4.6): a save planned gathered (boxes that follow no
layout) on 4 real ranks commits an index listing each chunk's box and the rank whose table holds it; a load on
ranks reads only the tables of the boxes it needs; forged boxes and tables are refused, naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from multiproc._inferred_ranks import full, load_expect_error, load_rows, save

import liferaft
from liferaft.codecs.checksum import digest
from liferaft.testing import run_ranks
from liferaft.testing.tamper import read_manifest, rewrite_manifest

NAMES = ("array_split", "odd_last")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("boxes") / "ckpt")
    run_ranks(save, 4, [path], NAMES)
    return path


def _copy(saved: str, tmp_path: Path, name: str = "copy") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(saved, dst)
    return dst


def test_the_index_lists_each_chunks_box_and_a_load_reads_only_the_tables_it_needs(saved):
    doc, _ = read_manifest(saved)
    assert doc["version"] == 4 and all("boxes" in t and "layout" not in t and not t["chunks"]
                                       for t in doc["tensors"])
    rows = {t["key"]: t["boxes"] for t in doc["tensors"]}["odd_last"]
    written = {tuple(o): r for r, o, _ in rows}                 # rows 0-3 by one of their replicas 0, 1, 3
    assert set(written) == {(0, 0), (4, 0)} and written[(4, 0)] == 2 and written[(0, 0)] in (0, 1, 3)
    got = run_ranks(load_rows, 2, saved, NAMES)                 # resharded: each rank its half of the rows
    for rank, res in enumerate(got):
        for n in NAMES:
            rows_n = full(n).shape[0]
            assert res[n] == full(n)[rank * rows_n // 2:(rank + 1) * rows_n // 2].tolist(), (n, rank)
    whole = liferaft.read(saved)
    assert all(torch.equal(whole[n], full(n)) for n in NAMES)
    liferaft.verify(saved)


def test_a_load_of_the_rows_one_rank_wrote_reads_its_table_only(saved, tmp_path):
    """``odd_last``'s rows 4-7 were written by rank 2 alone, rows 0-3 by one of ranks 0, 1, 3: with every other
    table damaged, reading rows 4-7 of ``odd_last`` still succeeds."""
    path = _copy(saved, tmp_path)
    for table in sorted(Path(path).glob("data/*/r*-chunks.json")):
        if not table.name.startswith("r00002"):
            table.write_bytes(b"{}")
    out = {"odd_last": liferaft.Sharded(torch.zeros(4, 2), (8, 2), (4, 0))}
    liferaft.load(path, out, options=liferaft.LoadOptions(ignore_keys=("array_split", "plain", "step")))
    assert torch.equal(out["odd_last"].local, full("odd_last")[4:])
    with pytest.raises(liferaft.CorruptCheckpointError, match=r"r0000[013]-chunks.json"):
        liferaft.read(path, ["odd_last"])


def _boxes_of(doc: dict, key: str) -> list:
    return next(t for t in doc["tensors"] if t["key"] == key)["boxes"]


@pytest.mark.parametrize("what", ["overlap", "gap", "twice", "beyond the world", "rank without a table",
                                  "a layout too", "a box outside the tensor", "not a list"])
def test_forged_boxes_are_refused(saved, tmp_path, what):
    path = _copy(saved, tmp_path)

    def edit(doc):
        boxes = _boxes_of(doc, "odd_last")
        if what == "overlap":
            boxes[1][1][0] -= 1
        elif what == "gap":
            boxes[1][2][0] -= 1
        elif what == "twice":
            boxes.append(list(boxes[0]))
        elif what == "beyond the world":
            boxes[0][0] = 4
        elif what == "rank without a table":
            doc["tables"] = [t for t in doc["tables"] if t["rank"] != boxes[0][0]]
        elif what == "a layout too":
            next(t for t in doc["tensors"] if t["key"] == "odd_last")["layout"] = {"mesh": [4], "shards": [0]}
        elif what == "a box outside the tensor":
            boxes[1][2][0] += 1
        else:
            next(t for t in doc["tensors"] if t["key"] == "odd_last")["boxes"] = {"0": 1}
    rewrite_manifest(path, edit)
    with pytest.raises(liferaft.CorruptCheckpointError):
        liferaft.inspect(path)
    errors = run_ranks(load_expect_error, 2, path, NAMES)
    assert all(e.startswith(("CorruptCheckpointError", "DistributedError")) for e in errors), errors


def test_a_table_listing_a_chunk_the_index_gives_another_rank_is_refused(saved, tmp_path):
    """Rank 2's table re-pinned with its chunk of ``odd_last`` claimed at rank 0's box: every reader refuses it,
    naming the table."""
    path = _copy(saved, tmp_path)
    doc, _ = read_manifest(path)
    pos = next(i for i, t in enumerate(doc["tensors"]) if t["key"] == "odd_last")
    table = next(p for p in Path(path).glob("data/*/r00002-chunks.json"))
    tdoc = json.loads(table.read_bytes())
    for i, c in tdoc["chunks"]:
        if i == pos:
            c["offsets"][0] = 0
    data = json.dumps(tdoc).encode()
    table.write_bytes(data)

    def pin(m):
        m["files"][str(table.relative_to(path))] = len(data)
        next(t for t in m["tables"] if t["rank"] == 2)["hash"] = digest(data)
    rewrite_manifest(path, pin)
    for tool in (liferaft.inspect, liferaft.verify, liferaft.read):
        with pytest.raises(liferaft.CorruptCheckpointError, match="r00002-chunks.json.*not a box the index lists"):
            tool(path)
    errors = run_ranks(load_expect_error, 2, path, NAMES)
    assert any("not a box the index lists" in e for e in errors), errors


def test_empty_tensors_in_an_index_of_explicit_boxes_load_and_read(tmp_path):
    from multiproc._inferred_ranks import load_with_empty, save_with_empty

    path = str(tmp_path / "ck")
    run_ranks(save_with_empty, 2, path)
    doc, _ = read_manifest(path)
    assert doc["version"] == 4 and {t["key"]: t["boxes"] for t in doc["tensors"]}["empty"] == []
    got = liferaft.read(path)
    assert got["empty"].shape == (0, 4) and got["empty_sharded"].shape == (0, 3)
    assert torch.equal(got["array_split"], full("array_split"))
    assert liferaft.read(path, ["empty"])["empty"].shape == (0, 4)
    assert run_ranks(load_with_empty, 2, path) == [True, True]
    liferaft.verify(path)


def test_a_reference_to_a_siblings_chunk_table_is_refused(tmp_path):
    """An incremental save's references may name only a sibling's data files, never its chunk tables."""
    from multiproc._inferred_ranks import save_with_empty

    root = tmp_path / "root"
    a, b = str(root / "a"), str(root / "b")
    run_ranks(save_with_empty, 2, a)
    run_ranks(save_with_empty, 2, b, "a")
    assert any(f.startswith("../a/") for f in read_manifest(b)[0]["files"])      # (it refers to a's data)
    table = min(Path(a).glob("data/*/r00000-chunks.json"))
    rel = "../a/" + str(table.relative_to(a))

    def refer(m):
        ref = next(f for f in m["files"] if f.startswith("../a/"))
        m["files"][rel] = table.stat().st_size
        for t in m["tensors"]:
            for c in t["chunks"]:
                if c["file"] == ref:
                    c["file"] = rel
    rewrite_manifest(b, refer)
    for tool in (liferaft.inspect, liferaft.read, liferaft.verify):
        with pytest.raises(liferaft.UnsafePathError, match="not a data file of the committed checkpoint 'a'"):
            tool(b)

