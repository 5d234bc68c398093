"""Checkpoints whose chunk records live in per-rank chunk tables (format version 4, docs/FORMAT.md §4.6), on real
ranks: the save writes one table per writing rank and a small index; loads on ranks read only the tables of the
ranks whose boxes they need, and every load (any layout, one process, the tools) gets exactly the state; a table
that is missing, damaged, or lists chunks its rank was not planned to write is refused before anything is copied,
naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from multiproc._tables_ranks import TENSORS, full, load, load_expect_error, load_one, save

import liferaft
from liferaft.codecs.checksum import digest
from liferaft.core.commit import open_checkpoint
from liferaft.storage import resolve
from liferaft.testing import run_ranks
from liferaft.testing.tamper import read_manifest, rewrite_manifest


def _tables(path: str) -> list[Path]:
    return sorted(Path(path).glob("data/*/r*-chunks.json"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tables") / "ckpt")
    run_ranks(save, 4, path)
    return path


def test_the_save_writes_an_index_and_one_table_per_writing_rank(saved):
    doc, _ = read_manifest(saved)
    assert doc["version"] == 4
    listed = {t["key"]: len(t["chunks"]) for t in doc["tensors"]}     # only the tensors every rank held whole
    assert listed == {"rows": 0, "cols": 0, "uneven": 0, "tiny": 0, "repl": 3, "plain": 2}
    assert {t["key"]: t["layout"] for t in doc["tensors"]}["rows"] == {"mesh": [4], "shards": [0]}
    assert [t["rank"] for t in doc["tables"]] == [0, 1, 2, 3]
    assert len(_tables(saved)) == 4
    info = liferaft.inspect(saved)
    assert info.format_version == 4 and {t.key for t in info.tensors} == {*TENSORS, "plain"}
    report = liferaft.verify(saved)             # every table read, every chunk re-hashed
    assert report.chunks > len(TENSORS) + 1 and report.bytes_checked == sum(t.nbytes for t in info.tensors)


def test_loads_get_the_state_in_every_layout_and_in_one_process(saved):
    for tables, exact, step in run_ranks(load, 4, saved):
        assert exact and step == 11 and tables >= 1
    for tables, exact, step in run_ranks(load, 2, saved):      # resharded
        assert exact and step == 11
    state = {n: torch.zeros(shape) for n, (shape, _) in TENSORS.items()} | {"plain": torch.zeros(300, 64), "step": 0}
    liferaft.load(saved, state)                                 # one process: every table
    assert all(torch.equal(state[n], full(n)) for n in [*TENSORS, "plain"]) and state["step"] == 11


def test_a_rank_reads_only_the_tables_of_the_ranks_that_wrote_its_boxes(saved):
    assert run_ranks(load_one, 4, saved, "rows") == [(1, True)] * 4          # its own only
    assert run_ranks(load_one, 2, saved, "rows") == [(2, True)] * 2          # the two halves it spans


def test_the_same_state_saved_without_tables_is_a_version_3_manifest(tmp_path):
    path = str(tmp_path / "v3")
    run_ranks(save, 2, path, False)
    doc, _ = read_manifest(path)
    assert doc["version"] < 4 and "tables" not in doc and not _tables(path)
    for tables, exact, _ in run_ranks(load, 2, path):
        assert tables is None and exact


def _copy(saved: str, tmp_path: Path) -> str:
    import shutil

    dst = str(tmp_path / "copy")
    shutil.copytree(saved, dst)
    return dst


def _refused(path: str, *words: str) -> None:
    """Every rank's load fails; the ranks that read the bad table name it (the others: a DistributedError)."""
    errors = run_ranks(load_expect_error, 2, path)
    assert all(e.startswith(("CorruptCheckpointError", "DistributedError")) for e in errors), errors
    assert all("CorruptCheckpointError" in e for e in errors), errors
    for w in words:
        assert all(w in e for e in errors), errors
    with pytest.raises(liferaft.CorruptCheckpointError):
        liferaft.inspect(path)


def test_a_damaged_or_missing_table_is_refused_naming_it(saved, tmp_path):
    path = _copy(saved, tmp_path)
    table = _tables(path)[1]
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 1
    table.write_bytes(bytes(data))
    _refused(path, table.name, "size/checksum")
    table.unlink()
    _refused(path, table.name, "missing")


def _forge(path: str, rank: int, edit) -> str:
    """Rewrite rank ``rank``'s table with ``edit(doc)`` and re-pin its size and digest in the index (what an
    attacker who writes a whole checkpoint can do): the table's bytes then reach the checks of its content."""
    table = _tables(path)[rank]
    doc = json.loads(table.read_bytes())
    edit(doc)
    data = json.dumps(doc).encode()
    table.write_bytes(data)

    def pin(m):
        m["files"][str(table.relative_to(path))] = len(data)
        ref = next(t for t in m["tables"] if t["rank"] == rank)
        ref["hash"], ref["chunks"] = digest(data), len(doc["chunks"])
    rewrite_manifest(path, pin)
    return table.name


def test_a_table_listing_a_chunk_its_rank_was_not_planned_to_write_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    rows = next(i for i, t in enumerate(read_manifest(path)[0]["tensors"]) if t["key"] == "rows")

    def shift(doc):             # rank 1 claims rank 0's rows (same bytes of its own file)
        for i, c in doc["chunks"]:
            if i == rows:
                c["offsets"][0] -= 64
    name = _forge(path, 1, shift)
    _refused(path, name, "not a piece of rank 1")


def test_a_table_that_drops_a_chunk_is_refused_not_read_as_zeros(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = _forge(path, 2, lambda doc: doc["chunks"].pop(0))
    errors = run_ranks(load_expect_error, 4, path)
    assert any("cover" in e and "CorruptCheckpointError" in e for e in errors) and "loaded" not in errors, errors
    with pytest.raises(liferaft.CorruptCheckpointError, match="does not tile|missing|cover"):
        liferaft.inspect(path)
    assert name


def test_a_table_of_another_save_or_rank_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = _forge(path, 3, lambda doc: doc.update(rank=2))
    _refused(path, name, "belongs to")
    path = _copy(saved, tmp_path / "bool")
    name = _forge(path, 1, lambda doc: doc.update(rank=True))        # (True == 1, but not a rank)
    _refused(path, name, "belongs to")


def test_a_table_pointing_into_another_ranks_file_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)

    def other(doc):
        for _, c in doc["chunks"]:
            c["file"] = c["file"].replace("r00001.bin", "r00000.bin")
    name = _forge(path, 1, other)
    _refused(path, name)


def test_the_index_refuses_tables_that_do_not_fit_it(saved, tmp_path):
    cases = {
        "another name": lambda m: m["tables"][0].update(file=m["tables"][1]["file"]),
        "a rank beyond the world": lambda m: m["tables"][0].update(rank=9),
        "chunks inline as well": lambda m: m["tensors"][0].update(chunks=[{}]),
        "a layout of other ranks": lambda m: m["tensors"][0].update(layout={"mesh": [3], "shards": [0]}),
        "a layout without tables": lambda m: (m.pop("tables"), m.pop("planned")),
        "tables in version 3": lambda m: m.update(version=3),
        "a tensor without a layout": lambda m: m["tensors"][-1].pop("layout"),
        "chunks below the smallest chunk_bytes": lambda m: m["planned"].update(chunk_bytes=1),
        "more chunks than its size can hold": lambda m: m["tables"][0].update(chunks=10 ** 9),
    }
    for what, edit in cases.items():
        path = _copy(saved, tmp_path / what.replace(" ", "_"))
        rewrite_manifest(path, edit)
        with pytest.raises(liferaft.CorruptCheckpointError):
            liferaft.inspect(path)
        assert os.path.exists(path), what


def test_a_state_held_whole_by_every_rank_keeps_one_manifest_and_no_sharded_chunk_still_loads(tmp_path):
    from multiproc._tables_ranks import load_odd, save_odd

    ddp, empty = str(tmp_path / "ddp"), str(tmp_path / "empty")
    run_ranks(save_odd, 2, ddp, "ddp")
    doc, _ = read_manifest(ddp)
    assert doc["version"] < 4 and not _tables(ddp)          # DDP: every load needs every chunk; one manifest
    run_ranks(save_odd, 2, empty, "empty")
    doc, _ = read_manifest(empty)
    assert doc["version"] == 4 and doc["tables"] == [] and not _tables(empty)     # no rank wrote a sharded chunk
    for path, kind in ((ddp, "ddp"), (empty, "empty")):
        assert run_ranks(load_odd, 2, path, kind) == [True, True]
        assert run_ranks(load_odd, 3, path, kind) == [True, True, True]
        liferaft.verify(path)


def test_the_chunks_the_index_lists_are_checked_before_a_load_on_ranks_reads_them(saved, tmp_path):
    """The tensors every rank held whole list their chunks in the index: overlapping or missing ones are refused
    by a load on ranks (which reads no table for them) as by the tools."""
    def overlap(m):
        repl = next(t for t in m["tensors"] if t["key"] == "repl")
        repl["chunks"][1]["offsets"][0] -= 1            # overlaps the first, leaves a gap at the end
    def missing(m):
        next(t for t in m["tensors"] if t["key"] == "plain")["chunks"].pop()
    for what, edit in (("overlap", overlap), ("missing", missing)):
        path = _copy(saved, tmp_path / what)
        rewrite_manifest(path, edit)
        errors = run_ranks(load_expect_error, 2, path)
        assert all(e.startswith("CorruptCheckpointError") and ("repl" in e or "plain" in e) for e in errors), errors
        with pytest.raises(liferaft.CorruptCheckpointError):
            liferaft.inspect(path)


def test_a_listing_of_steps_reads_no_table_and_a_restore_passes_over_a_step_whose_table_is_damaged(saved, tmp_path):
    """A manager root's listing opens a version 4 step's index only (its tables: by the load, or ``verify``);
    a restore whose newest step has a damaged table loads the step before, with a warning naming the table."""
    import shutil

    from multiproc._tables_ranks import TENSORS, full

    from liferaft.manager.listing import list_steps

    root = tmp_path / "root"
    for step in (1, 2):
        shutil.copytree(saved, root / f"step-{step:010d}")
    table = _tables(str(root / "step-0000000002"))[0]
    data = bytearray(table.read_bytes())
    data[-3] ^= 1
    table.write_bytes(bytes(data))
    listed = {i.step: i.status for i in list_steps(resolve(str(root)))}
    assert listed == {1: "committed", 2: "committed"}
    deep = {i.step: (i.status, i.reason) for i in list_steps(resolve(str(root)), deep=True)}
    assert deep[1][0] == "committed" and deep[2][0] == "corrupt" and table.name in deep[2][1]
    state = {n: torch.zeros(shape) for n, (shape, _) in TENSORS.items()} | {"plain": torch.zeros(300, 64), "step": 0}
    with liferaft.CheckpointManager(str(root)) as manager, pytest.warns(UserWarning, match=table.name):
        assert manager.restore(state) == 1
    assert all(torch.equal(state[n], full(n)) for n in [*TENSORS, "plain"])


def test_an_index_whose_layout_disagrees_with_its_tables_is_refused_by_loads_and_by_the_tools(saved, tmp_path):
    """The tables are the save's plan for the layouts the index records: an index re-pinned with another layout
    (here ``rows`` on a 2 x 2 mesh instead of 4 ranks in a row) is refused by ``inspect`` and ``verify`` as by a
    load, naming the table whose chunks were not planned."""
    path = _copy(saved, tmp_path)

    def relayout(m):
        next(t for t in m["tensors"] if t["key"] == "rows")["layout"] = {"mesh": [2, 2], "shards": [0, None]}
    rewrite_manifest(path, relayout)
    errors = run_ranks(load_expect_error, 2, path)
    assert all("CorruptCheckpointError" in e and ("was planned" in e or "not a piece" in e) for e in errors), errors
    for tool in (liferaft.inspect, liferaft.verify, liferaft.read):
        with pytest.raises(liferaft.CorruptCheckpointError, match="chunks.json"):
            tool(path)


def test_verify_streams_the_tables_reporting_every_damaged_one_and_read_reads_only_the_tables_it_needs(
        saved, tmp_path):
    """``verify`` reads one table at a time: each damaged or missing table is its own fault and the others are
    still checked; ``read`` of a few keys reads only the tables holding them (the tensors every rank held whole:
    none)."""
    path = _copy(saved, tmp_path)
    tables = _tables(path)
    data = bytearray(tables[1].read_bytes())
    data[-3] ^= 1
    tables[1].write_bytes(bytes(data))
    tables[3].unlink()
    with pytest.raises(liferaft.CorruptCheckpointError) as e:
        liferaft.verify(path)
    msg = str(e.value)
    assert tables[1].name in msg and tables[3].name in msg, msg
    assert "lack the elements of the 2 chunk table(s)" in msg, msg
    got = liferaft.read(path, ["plain", "repl", "step"])         # their chunks are in the index
    assert torch.equal(got["plain"], full("plain")) and torch.equal(got["repl"], full("repl"))
    for key in ("rows", "tiny"):                                 # rank 1 wrote a chunk of each
        with pytest.raises(liferaft.CorruptCheckpointError, match=tables[1].name):
            liferaft.read(path, [key])


def test_verify_names_each_tensor_a_table_that_lacks_chunks_leaves_short(saved, tmp_path):
    """A table re-pinned in the index with its chunks of one tensor dropped: every table reads, and the tensor
    is short of the elements those chunks held."""
    path = _copy(saved, tmp_path)
    rows = next(i for i, t in enumerate(read_manifest(path)[0]["tensors"]) if t["key"] == "rows")

    def drop_rows(doc):
        doc["chunks"] = [c for c in doc["chunks"] if c[0] != rows]
    _forge(path, 2, drop_rows)
    with pytest.raises(liferaft.CorruptCheckpointError, match=r"tensor 'rows': the chunk tables hold \d+ of its "
                                                              r"40960 elements"):
        liferaft.verify(path)


def test_inspect_and_describe_stream_the_tables_and_report_what_the_whole_manifest_says(saved, tmp_path):
    from liferaft.core.open import open_reader

    whole = open_checkpoint(resolve(saved))                 # (every table read into one manifest)
    counts = {t.key: len(t.chunks) for t in whole.tensors}
    assert {t.key: t.chunks for t in liferaft.inspect(saved).tensors} == counts
    for info in liferaft.describe(saved):
        entry = whole.tensor_map()[info.key]
        assert info.chunks == counts[info.key] and info.stored_bytes == sum(c.stored_length for c in entry.chunks)
        assert info.files == len({c.file for c in entry.chunks}), info
    reader = open_reader(saved, lazy=True)
    try:                                                    # streamed: no table kept by the reader
        assert sum(1 for _ in reader.chunk_infos(["rows"])) == counts["rows"] and reader.tables_read == 0
    finally:
        reader.close()
    path = _copy(saved, tmp_path)
    _forge(path, 2, lambda doc: doc["chunks"].pop(0))
    with pytest.raises(liferaft.CorruptCheckpointError, match="chunks are missing"):
        liferaft.describe(path, ["rows", "cols", "uneven", "tiny"])
