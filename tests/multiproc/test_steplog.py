"""The per-step log (docs/STEPLOG.md): a run killed by SIGKILL resumes from the last completed step, not the last
full checkpoint, bitwise equal to an uninterrupted run — DDP and FSDP2, AdamW and SGD, two micro-batches, a
GradScaler that skips a step, an LR scheduler; the loss of a node's memory costs at most one step; another world
size falls back to the full checkpoint; a damaged record stops the replay before it; retention frees records."""

from __future__ import annotations

import glob
import os
import shutil
import warnings

import pytest
from multiproc import _steplog_pp_ranks
from multiproc._steplog_ranks import INF_STEP, job, replay_alone

from liferaft.testing import RankFailure, run_ranks

LAST, KILL = 11, 7          # full checkpoints at 0, 4, 8: the kill at 7 is 3 steps past the newest (4)


def _equal(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors: dtype, shape and every byte; plain values: their repr)."""
    return [k for k in a if k not in b or a[k] != b[k]] + [k for k in b if k not in a]


_RUNS: dict = {}            # the uninterrupted and the killed runs, each run once per module (below)


@pytest.fixture(scope="module", autouse=True)
def _runs_dir(tmp_path_factory):
    _RUNS.clear()
    _RUNS["dir"] = tmp_path_factory.mktemp("steplog-runs")
    yield
    _RUNS.clear()


def _reference(tmp_path, kind, opt):
    """The uninterrupted run of ``kind`` / ``opt`` (once per module: what it returns does not depend on where)."""
    key = ("ref", kind, opt)
    if key not in _RUNS:
        d = _RUNS["dir"] / f"ref-{kind}-{opt}"
        _RUNS[key] = run_ranks(job, 2, str(d / "ref"), str(d / "ref-shm"), kind, opt, LAST, None, timeout=180)
    return _RUNS[key]


def _crash(tmp_path, kind, opt, kill=KILL):
    """The root and memory tier of the run of ``kind`` / ``opt`` killed after step ``kill``, as the kill left them:
    run once per module and copied back before each use, to the same paths (the per-step log's namespace is named
    after the root's path)."""
    d = _RUNS["dir"] / f"crash-{kind}-{opt}-{kill}"
    work, pristine = d / "work", d / "pristine"
    if pristine.exists():
        shutil.rmtree(work)
        shutil.copytree(pristine, work, symlinks=True)
    else:
        with pytest.raises(RankFailure):
            run_ranks(job, 2, str(work / "run"), str(work / "shm"), kind, opt, LAST, kill, timeout=180)
        shutil.copytree(work, pristine, symlinks=True)
    return str(work / "run"), str(work / "shm")


def _check_resumed(out, ref, start):
    for rank in range(2):
        assert out[rank]["start"] == start, out[rank]["recovery"]
        assert out[rank]["recovery"]["full"] == 4
        for step, loss in out[rank]["losses"].items():     # the losses after the resume, bit for bit
            assert loss == ref[rank]["losses"][step], (rank, step)
        assert not _equal(out[rank]["state"], ref[rank]["state"]), _equal(out[rank]["state"], ref[rank]["state"])


@pytest.mark.parametrize("kind,opt", [("ddp", "adamw"), ("ddp", "sgd"), ("fsdp", "adamw"), ("fsdp", "sgd")])
def test_kill_9_resumes_from_the_last_step_bitwise(tmp_path, kind, opt):
    ref = _reference(tmp_path, kind, opt)
    root, base = _crash(tmp_path, kind, opt)
    out = run_ranks(job, 2, root, base, kind, opt, LAST, None, timeout=180)
    _check_resumed(out, ref, KILL)          # no step lost: the log held 5, 6, 7 past the full checkpoint 4


def test_lost_node_memory_resumes_from_the_peer_replica(tmp_path):
    ref = _reference(tmp_path, "ddp", "adamw")
    root, base = _crash(tmp_path, "ddp", "adamw")
    shutil.rmtree(os.path.join(base, "steplog-test", "node1"))      # rank 1's node lost its memory
    out = run_ranks(job, 2, root, base, "ddp", "adamw", LAST, None, timeout=180)
    assert out[0]["start"] in (KILL - 1, KILL), out[0]["recovery"]  # at most one step lost
    assert out[1]["recovery"]["fetched"] >= 1
    _check_resumed(out, ref, out[0]["start"])


def test_kill_9_before_the_first_interval_save_resumes_at_the_last_step(tmp_path):
    """No interval save before the kill: the manager took a full checkpoint at the first maybe_save (step 0) by
    itself, so the records 1..KILL replay onto it — no step lost, bitwise."""
    ref = run_ranks(job, 2, str(tmp_path / "ref"), str(tmp_path / "ref-shm"), "ddp", "adamw", LAST, None, 64,
                    True, None, timeout=180)
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    with pytest.raises(RankFailure):
        run_ranks(job, 2, root, base, "ddp", "adamw", LAST, KILL, 64, True, None, timeout=180)
    out = run_ranks(job, 2, root, base, "ddp", "adamw", LAST, None, 64, True, None, timeout=180)
    for rank in range(2):
        assert out[rank]["start"] == KILL, out[rank]["recovery"]
        assert out[rank]["recovery"]["full"] == 0 and out[rank]["recovery"]["replayed"] == KILL
        assert out[rank]["recovery"]["rest_loads"] == 1
        for step, loss in out[rank]["losses"].items():
            assert loss == ref[rank]["losses"][step], (rank, step)
        assert not _equal(out[rank]["state"], ref[rank]["state"]), _equal(out[rank]["state"], ref[rank]["state"])


@pytest.mark.parametrize("kind", ["ddp", "mixed"])
def test_replicated_gradients_are_not_sent_and_a_lost_node_still_recovers_bitwise(tmp_path, kind):
    """DDP gradients are the same bytes on both ranks: the peer's replica takes them from its own record instead
    of the wire. ``mixed``: a part of the model each rank trains on its own data (its gradients differ between
    the ranks, found by their checksums): those are sent in full, and rank 1's records rebuilt on rank 0's node
    still replay bitwise after rank 1's node lost its memory."""
    ref = _reference(tmp_path, kind, "sgd")
    root, base = _crash(tmp_path, kind, "sgd")
    lost, peer, home = (glob.glob(os.path.join(base, "steplog-test", node, "steplog", "*", r))[0]
                        for node, r in (("node1", "r00001"), ("node0", "r00001"), ("node0", "r00000")))
    same, thin = _same_records(lost, peer, home)    # rank 1's records as its node wrote them = its replicas
    # every gradient the peer holds stays home (INF_STEP: GradScaler skipped the optimizer step, no gradient)
    assert len(same) >= 3 and thin == [s for s in same if s != INF_STEP] and max(same) >= KILL - 1, (same, thin)
    shutil.rmtree(os.path.join(base, "steplog-test", "node1"))
    with warnings.catch_warnings(record=True):
        out = run_ranks(job, 2, root, base, kind, "sgd", LAST, None, timeout=180)
    assert out[0]["start"] in (KILL - 1, KILL), out[0]["recovery"]
    why = out[1]["recovery"]["why"]                 # (at most the record in flight at the kill is missing)
    assert out[1]["recovery"]["fetched"] >= 1 and "refused" not in why and "checksum" not in why, why
    _check_resumed(out, ref, out[0]["start"])
    for rank in range(2):
        assert out[rank]["unsent"] > 0                      # the DDP gradients stayed home
        assert (out[rank]["diverged"] > 0) == (kind == "mixed"), out[rank]


def _same_records(a: str, b: str, home: str) -> tuple[list[int], list[int]]:
    """Steps whose record is held in both slot folders, checked byte for byte equal once the replica in ``b`` has
    its held runs filled from its node's own record (in ``home``), as a recovery does; and the steps whose replica
    had held runs. A replica whose home slot holds a newer step since is stale (its step is at or below a durable
    full checkpoint: a recovery does not list it either) and skipped."""
    from liferaft.tiers.steprecord import fill_held, read_header, read_held, read_record

    out, thin = [], []
    for name in sorted(os.listdir(b)):
        ha, hb = read_header(a, name), read_header(b, name)
        if ha is not None and hb is not None and ha.step == hb.step:
            replica = read_record(b, name, hb.length)
            held = read_held(b, name, hb.length)
            if held is not None:
                own = f"slot-{held.own_slot:04d}"
                ho = read_header(home, own)
                assert held.step == hb.step and ho is not None, (name, held)
                if ho.step != held.step:
                    continue
                fill_held(replica, held, read_record(home, own, ho.length), name)
                thin.append(hb.step)
            assert read_record(a, name, ha.length) == replica, name
            out.append(hb.step)
    return out, thin


def test_another_world_size_falls_back_to_the_full_checkpoint(tmp_path):
    root, base = _crash(tmp_path, "ddp", "adamw")
    out = run_ranks(job, 1, root, base, "ddp", "adamw", 4, None, 64, False, timeout=180)
    assert out[0]["start"] == 4 and "world size" in out[0]["recovery"]["why"], out[0]["recovery"]


def _damage(path, damage):
    from liferaft.tiers.steprecord import read_header, read_held

    h = read_header(os.path.dirname(path), os.path.basename(path))
    data = bytearray(open(path, "rb").read())
    if damage == "flip" and read_held(os.path.dirname(path), os.path.basename(path), h.length) is None:
        data[100] ^= 0xFF                               # a gradient byte
    elif damage == "flip":                              # a replica whose gradients its node's own record holds:
        rest = [e for es in h.doc["rest"]["tensors"].values() for e in es if e["len"]]
        data[rest[0]["off"]] ^= 0xFF                    # a byte it holds itself
    elif damage == "truncate":
        data = data[:h.header_off - 10]
    else:
        data[h.header_off + 5] ^= 0x01                  # the header
    with open(path, "wb") as f:
        f.write(data)


def _slot_of(folder, step):
    from liferaft.tiers.steprecord import read_header

    return next(os.path.join(folder, f) for f in sorted(os.listdir(folder))
                if (h := read_header(folder, f)) is not None and h.step == step)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "flip-own-copy-only", "flip-held-home"])
def test_a_damaged_record_stops_the_replay_before_it(tmp_path, damage):
    """Rank 1's record of step 6 damaged on its node and on its replica's: the replay stops at 5 (never a wrong
    state); damaged on its own node only: the replica's copy is taken and nothing is lost. ``held-home``: rank
    1's record damaged on its node, and the replica on rank 0's node whole but for its gradients, which it takes
    from rank 0's own record of step 6 (held home) — damaged too: that replica is refused, never served wrong."""
    ref = _reference(tmp_path, "ddp", "adamw")
    root, base = _crash(tmp_path, "ddp", "adamw")
    copies = {"only": [("node1", "r00001")], "home": [("node1", "r00001"), ("node0", "r00000")]}.get(
        damage.split("-")[-1], [("node1", "r00001"), ("node0", "r00001")])
    for node, r in copies:
        _damage(_slot_of(glob.glob(os.path.join(base, "steplog-test", node, "steplog", "*", r))[0], 6), damage.split("-")[0])
    out = run_ranks(job, 2, root, base, "ddp", "adamw", LAST, None, timeout=180)
    _check_resumed(out, ref, KILL if damage.endswith("only") else 5)
    if damage == "flip-held-home":                      # rank 0's own copy and the replica of it on node1 (held
        assert "checksum" in out[0]["recovery"]["why"] + out[1]["recovery"]["why"]   # there, damaged) refused
    if not damage.endswith("only") and damage == "flip":
        assert "slot-" in out[0]["recovery"]["why"] + out[1]["recovery"]["why"]     # names the file


def test_retention_frees_records_once_a_full_checkpoint_is_durable(tmp_path):
    out = run_ranks(job, 2, str(tmp_path / "r"), str(tmp_path / "shm"), "ddp", "sgd", 10, None, 3, timeout=180)
    for rank in range(2):
        # full checkpoints at 0, 4, 8 (and whenever the 3-slot ring filled): nothing at or below the durable step
        assert all(s > out[rank]["durable"] for s in out[rank]["held"]), out[rank]
        assert len(out[rank]["held"]) <= 3
    slots = os.listdir(glob.glob(os.path.join(str(tmp_path / "shm"), "steplog-test", "node0", "steplog", "*", "r00000"))[0])
    assert len(slots) <= 3


def test_an_auto_ring_takes_the_smallest_size_any_rank_found_and_stays_in_step(tmp_path):
    # rank 1's node has room for 4 records in its share (a share of 1/2^40 of its shared memory), rank 0's for
    # 256: both rings hold 4, so that a ring voted full is full on both and both take the same synchronous save
    small = run_ranks(job, 2, str(tmp_path / "r"), str(tmp_path / "shm"), "ddp", "sgd", 14, None, "auto", True,
                      None, [4, 1 << 40], timeout=180)
    for rank in range(2):
        assert small[rank]["ring"] == 4, small[rank]
        assert all(s > small[rank]["durable"] for s in small[rank]["held"]) and len(small[rank]["held"]) <= 4
    big = run_ranks(job, 2, str(tmp_path / "r2"), str(tmp_path / "shm2"), "ddp", "sgd", 14, None, "auto", True,
                    None, timeout=180)
    assert big[0]["ring"] == big[1]["ring"] > 4               # (the default share: the cap, or what fits)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_replay_makes_no_collective_under_fsdp2(opt):
    assert run_ranks(replay_alone, 2, opt, timeout=60, pg_timeout=20) == [True, True]


def test_ranks_placed_on_other_nodes_at_a_restart_still_recover_from_held_replicas(tmp_path):
    """Run 1 has rank 0 on node0 and rank 1 on node1; rank 1 is killed and node1's memory is lost; the restart
    places rank 0 on the new node1 and rank 1 on node0 (ranks assigned by arrival, as torchrun elastic does).
    node0 holds rank 1's records as replicas whose gradients are in rank 0's records there, now in a folder of a
    rank on another node: they are filled from those and replayed — no step lost but the one in flight, bitwise,
    and no copy reported damaged."""
    ref = _reference(tmp_path, "ddp", "sgd")
    root, base = _crash(tmp_path, "ddp", "sgd")
    shutil.rmtree(os.path.join(base, "steplog-test", "node1"))
    out = run_ranks(job, 2, root, base, "ddp", "sgd", LAST, None, 64, ["node1", "node0"], timeout=180)
    assert out[0]["start"] in (KILL - 1, KILL), out[0]["recovery"]
    assert "refused" not in out[0]["recovery"]["why"] + out[1]["recovery"]["why"], out[0]["recovery"]
    _check_resumed(out, ref, out[0]["start"])


def test_held_replicas_are_filled_from_their_holder_among_several_ranks_of_a_node(tmp_path):
    """2 nodes × 2 ranks, stage = local position, data parallel across nodes: a replica on node n1 of rank 0's
    records holds its gradients in rank 2's records (same stage), not in rank 3's (the other stage, longer
    records). After node n0 lost its memory every rank replays all 5 steps from what n1 holds, bitwise."""
    base = str(tmp_path)
    ref = run_ranks(_steplog_pp_ranks.job, 4, base + "/ref", 5, False, timeout=120)
    run_ranks(_steplog_pp_ranks.job, 4, base + "/shm", 5, False, timeout=120)
    shutil.rmtree(os.path.join(base, "shm", "pp", "n0"))
    with warnings.catch_warnings(record=True):
        out = run_ranks(_steplog_pp_ranks.job, 4, base + "/shm", 5, True, timeout=150, pg_timeout=60)
    for r in range(4):
        assert out[r]["recovery"]["replayed_to"] == 5 and not out[r]["recovery"]["why"], (r, out[r]["recovery"])
        assert out[r]["state_at_start"] == ref[r]["after5"], r
    assert out[0]["recovery"]["fetched"] == out[1]["recovery"]["fetched"] == 5


def test_a_held_trailer_naming_bytes_outside_its_holder_is_refused_without_waiting(tmp_path):
    """A crafted held trailer (its digest recomputed) whose run lies past the holder's record: the listing refuses
    that replica, naming it, and the recovery stops before its step at once — never a peer waiting out the
    timeout for a record its holder cannot send, never wrong bytes."""
    from liferaft.tiers.steprecord import held_trailer, read_header, read_held

    ref = _reference(tmp_path, "ddp", "adamw")
    root, base = _crash(tmp_path, "ddp", "adamw")
    rep = glob.glob(os.path.join(base, "steplog-test", "node0", "steplog", "*", "r00001"))[0]
    path = _slot_of(rep, 6)
    h = read_header(rep, os.path.basename(path))
    held = read_held(rep, os.path.basename(path), h.length)
    assert held is not None
    runs = [(1 << 30, d, k) for _, d, k in held.runs]
    with open(path, "r+b") as f:
        f.seek(h.length)
        f.write(held_trailer(held.step, held.source, held.holder, held.own_slot, runs))
    shutil.rmtree(os.path.join(base, "steplog-test", "node1"))
    with warnings.catch_warnings(record=True):
        out = run_ranks(job, 2, root, base, "ddp", "adamw", LAST, None, timeout=180)
    _check_resumed(out, ref, 5)
    assert "outside" in out[0]["recovery"]["why"] and os.path.basename(path) in out[0]["recovery"]["why"]
