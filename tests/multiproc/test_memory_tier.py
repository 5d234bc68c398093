"""The memory tier on real ranks grouped into simulated nodes (2 ranks per node, each node its own shared-memory
namespace under /dev/shm): kill a process, lose a node, lose every node, change the world size after a node loss.
Every restore is checked bit for bit against the state saved at that step."""

from __future__ import annotations

import os
import shutil

import pytest
from multiproc._tier_ranks import held, job, release

from liferaft.testing import RankFailure, run_ranks


@pytest.fixture
def base(shm):
    return shm


def test_every_node_commits_and_holds_replicas_of_the_other(base, tmp_path):
    out = run_ranks(job, 4, base, str(tmp_path / "disk"), 2, 2, 100, timeout=120)
    assert out == [("none", None, True)] * 4
    files = held(base)
    assert set(files) == {"n0", "n1"}
    for node, mine, replicas in (("n0", (0, 1), (2, 3)), ("n1", (2, 3), (0, 1))):
        step2 = [f for f in files[node] if f.startswith("step-0000000002/")]
        assert "step-0000000002/COMMIT" in step2
        for r in mine + replicas:
            assert any(f.endswith(f"/r{r:05d}.bin") for f in step2), (node, r, step2)
        assert not any(f.startswith("step-0000000000/") for f in files[node])      # keep=2: steps 1, 2


def test_a_killed_process_restores_from_its_node_memory(base, tmp_path):
    disk = str(tmp_path / "disk")
    with pytest.raises(RankFailure):
        run_ranks(job, 4, base, disk, 2, 5, 100, 3, timeout=120)      # rank 1 dies after step 3's memory save
    out = run_ranks(job, 4, base, disk, 2, 4, 100, timeout=120)
    assert {o[0] for o in out} == {"memory"} and {o[1] for o in out} == {3} and all(o[2] for o in out), out


def test_a_lost_node_restores_from_peer_replicas(base, tmp_path):
    disk = str(tmp_path / "disk")
    run_ranks(job, 4, base, disk, 2, 3, 2, timeout=120)
    shutil.rmtree(os.path.join(base, "tier-test", "n1"))                  # node 1 gone: its processes and memory
    out = run_ranks(job, 4, base, disk, 2, 4, 100, timeout=120)           # a replacement node 1 joins, empty
    assert out == [("memory", 3, True)] * 4, out


def test_a_node_killed_mid_run_restores_from_peer_replicas(base, tmp_path):
    disk = str(tmp_path / "disk")
    with pytest.raises(RankFailure):                                      # node 1's ranks die after step 3 ...
        run_ranks(job, 4, base, disk, 2, 6, 100, 3, (2, 3), timeout=120)
    shutil.rmtree(os.path.join(base, "tier-test", "n1"))                 # ... and its memory with them
    out = run_ranks(job, 4, base, disk, 2, 4, 100, timeout=120)
    assert out == [("memory", 3, True)] * 4, out


def test_a_lost_node_gets_byte_ranges_from_peers_not_files(base, tmp_path):
    """Saved on 2 nodes of one rank each; node 1 lost; restored on 4 ranks (2 per node, another world size): the
    ranks of node 1 receive the byte ranges their shards need from node 0's ranks, and no data file is copied
    into node 1's memory (only the commit)."""
    disk = str(tmp_path / "disk")
    run_ranks(job, 2, base, disk, 1, 3, 100, timeout=120)
    shutil.rmtree(os.path.join(base, "tier-test", "n1"))
    out = run_ranks(job, 4, base, disk, 2, 3, 100, timeout=120)            # restores step 3, saves nothing new
    assert out == [("memory", 3, True)] * 4, out
    step3 = [f for f in held(base)["n1"] if f.startswith("step-0000000003/")]
    assert "step-0000000003/COMMIT" in step3 and not any(f.endswith(".bin") for f in step3), step3


def _damage(base, tmp_path, kill_rank=None):
    import json

    from multiproc._tier_ranks import restore_damaged

    out = tmp_path / "out"
    out.mkdir()
    try:
        run_ranks(restore_damaged, 4, base, 2, str(out), kill_rank, timeout=120)
    except RankFailure as e:
        assert kill_rank is not None and set(e.errors) == {kill_rank}, e
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


def test_a_corrupt_byte_in_a_peers_memory_is_detected_never_loaded(base, tmp_path):
    """One byte flipped in node 0's replica of rank 2's file, node 1 lost: the restore raises
    CorruptCheckpointError on the rank that received it, naming the file, and on the others as a DistributedError
    that carries it (no other copy is tried); no damaged byte lands."""
    got = _damage(base, tmp_path)
    assert sorted(got) == [0, 1, 2, 3]
    assert got[2][0] == "CorruptCheckpointError" and "r00002.bin" in got[2][1], got[2]
    for rank, (kind, message, clean) in got.items():          # the others: rank 2's error, through the group
        assert clean and (rank == 2 or kind == "DistributedError" and "CorruptCheckpointError" in message), \
            (rank, kind, message)


def test_a_peer_killed_during_the_transfer_is_a_clear_error(base, tmp_path):
    """Rank 1 (node 0, a holder sending ranges to node 1) is killed -9 during the restore: the others raise a
    liferaft error (within the tier's timeout: the launcher's deadline would report a hang), nothing damaged lands."""
    got = _damage(base, tmp_path, kill_rank=1)
    assert sorted(got) == [0, 2, 3], got
    for rank, (kind, message, clean) in got.items():
        assert kind in ("DistributedError", "CorruptCheckpointError") and clean, (rank, kind, message)


def test_losing_both_replicas_falls_back_to_disk(base, tmp_path):
    disk = str(tmp_path / "disk")
    run_ranks(job, 4, base, disk, 2, 3, 2, timeout=120)                   # disk has step 2; memory 2 and 3
    shutil.rmtree(os.path.join(base, "tier-test", "n0"))
    shutil.rmtree(os.path.join(base, "tier-test", "n1"))
    out = run_ranks(job, 4, base, disk, 2, 3, 100, timeout=120)
    assert out == [("disk", 2, True)] * 4, out


def test_fewer_ranks_after_a_node_loss_reshard_from_the_survivor(base, tmp_path):
    disk = str(tmp_path / "disk")
    run_ranks(job, 4, base, disk, 2, 3, 100, timeout=120)
    shutil.rmtree(os.path.join(base, "tier-test", "n1"))
    out = run_ranks(job, 2, base, disk, 2, 3, 100, timeout=120)           # only node 0 left: 2 ranks
    assert out == [("memory", 3, True)] * 2, out


def test_release_frees_the_nodes_memory(base, tmp_path):
    run_ranks(job, 4, base, str(tmp_path / "disk"), 2, 1, 100, timeout=120)
    run_ranks(release, 4, base, 2, timeout=60)
    assert held(base) == {}


def test_manager_restores_from_memory_when_it_is_newest_else_from_the_root(base, tmp_path):
    from multiproc._tier_ranks import managed

    root = str(tmp_path / "root")
    assert [o[:2] for o in run_ranks(managed, 4, base, root, 2, 6, timeout=120)] == [(None, True)] * 4
    # memory: step 6 (keep=1); root: steps 0 and 4, drained from memory (the same saves, copied, not re-staged)
    assert sorted(d for d in os.listdir(root) if d.startswith("step-")) == ["step-0000000000", "step-0000000004"]
    out = run_ranks(managed, 4, base, root, 2, 6, timeout=120)
    assert [o[:2] for o in out] == [(6, True)] * 4 and all(o[2]["step"] == 6 for o in out)
    assert out[0][2]["listing"] == [(0, ("root",)), (4, ("root",)), (6, ("memory",))]
    shutil.rmtree(os.path.join(base, "tier-test"))                       # every node lost
    assert [o[:2] for o in run_ranks(managed, 4, base, root, 2, 6, timeout=120)] == [(4, True)] * 4


def test_tiers_mix_when_both_copies_of_some_ranks_are_lost(base, tmp_path):
    from multiproc._tier_ranks import managed

    root = str(tmp_path / "root")
    run_ranks(managed, 4, base, root, 2, 4, timeout=120)                  # step 4: memory and drained to root
    shutil.rmtree(os.path.join(base, "tier-test", "n1"))                 # node 1 lost, and with it ...
    for r in (2, 3):                                                      # ... the replicas of its ranks on node 0
        for d, _, fs in os.walk(os.path.join(base, "tier-test", "n0")):
            for f in fs:
                if f == f"r{r:05d}.bin":
                    os.remove(os.path.join(d, f))
    out = run_ranks(managed, 4, base, root, 2, 4, timeout=120)
    assert [o[:2] for o in out] == [(4, True)] * 4
    info = out[0][2]                       # rank 0 leads node 0: ranks 2 and 3's files came from the root's copy
    assert info["step"] == 4 and info["files_from_fallback"] == 2, out


def test_three_tiers_memory_root_remote(base, tmp_path):
    from multiproc._tier_ranks import managed

    root, remote = str(tmp_path / "root"), str(tmp_path / "remote")
    run_ranks(managed, 4, base, root, 2, 9, True, remote, timeout=120)
    steps = lambda d: sorted(x for x in os.listdir(d) if x.startswith("step-"))
    assert steps(root) == ["step-0000000000", "step-0000000004", "step-0000000008"]
    assert steps(remote) == ["step-0000000000", "step-0000000008"]            # every 2nd root save, drained too
    out = run_ranks(managed, 4, base, root, 2, 9, True, remote, timeout=120)
    assert [o[:2] for o in out] == [(9, True)] * 4                             # memory: the newest
    shutil.rmtree(os.path.join(base, "tier-test"))
    shutil.rmtree(root)                                                       # the node-local disk is gone too
    out = run_ranks(managed, 4, base, root, 2, 9, True, remote, timeout=120)
    assert [o[:2] for o in out] == [(8, True)] * 4                             # from the remote tier


def test_files_cross_in_many_pieces_with_two_in_flight(tmp_path):
    from multiproc._tier_ranks import transfer_in_pieces

    assert run_ranks(transfer_in_pieces, 2, str(tmp_path)) == [True, True]


def test_files_cross_around_a_ring_both_ways_at_once(tmp_path):
    """Each rank sends its files to the next while it receives the previous rank's (a thread per direction), in
    pieces, twice through the same kept buffers: every file arrives whole, whatever order the plan lists it in."""
    from multiproc._tier_ranks import transfer_ring

    assert run_ranks(transfer_ring, 3, str(tmp_path)) == [[True, True]] * 3


def test_a_receiver_that_cannot_write_reports_its_own_cause_at_once_and_the_senders_finish(tmp_path):
    """(Regression: with both directions at once, a rank whose /dev/shm was full waited out the timeout and reported
    a peer's timeout.) It drops the rest of what it receives, removes its partial files and raises ENOSPC; the
    other ranks' transfers complete; no receiving thread is left."""
    from multiproc._tier_ranks import transfer_with_a_local_failure

    out = run_ranks(transfer_with_a_local_failure, 3, str(tmp_path), "full", timeout=120)
    assert out[0][0] == "ok" and out[2][0] == "ok", out
    assert out[1][0].startswith("OSError") and "No space left" in out[1][0], out[1]
    assert out[1][1] < 3.0 and all(not left for *_, left in out), out     # (not the 4 s timeout)
    assert not any(p.name.startswith("f") for p in (tmp_path / "r1").iterdir() if p.name != "f1")


def test_a_sender_whose_file_shrank_says_so_and_its_peers_time_out_bounded(tmp_path):
    """(Before, the missing bytes went out as stale buffer bytes and the transfer reported success.)"""
    from multiproc._tier_ranks import transfer_with_a_local_failure

    out = run_ranks(transfer_with_a_local_failure, 3, str(tmp_path), "short", timeout=120)
    assert out[1][0].startswith("CorruptCheckpointError") and "shorter than" in out[1][0], out[1]
    assert all(o[0].startswith("DistributedError") for o in (out[0], out[2])), out
    assert all(o[1] < 30 for o in out) and all(not left for *_, left in out), out


def test_a_rollback_removes_the_newer_steps_from_every_node_the_root_and_the_remote_tier(base, tmp_path):
    """Run to step 9 (memory: 9 on every node; root: 0 4 8; remote: 0 8), then roll back to 4 and go on to 6: the
    steps after 4 go from every tier before the first save, so a restart resumes the new run (6, from memory),
    and with every node lost the root's 4, never the remote tier's abandoned 8."""
    from multiproc._tier_ranks import managed

    root, remote = str(tmp_path / "root"), str(tmp_path / "remote")
    steps = lambda d: sorted(x for x in os.listdir(d) if x.startswith("step-"))
    run_ranks(managed, 4, base, root, 2, 9, True, remote, timeout=120)
    assert steps(remote) == ["step-0000000000", "step-0000000008"]
    out = run_ranks(managed, 4, base, root, 2, 6, True, remote, 4, timeout=120)
    assert [o[:2] for o in out] == [(4, True)] * 4
    assert steps(root) == ["step-0000000000", "step-0000000004"] and steps(remote) == ["step-0000000000"]
    for node in ("n0", "n1"):
        held = steps(os.path.join(base, "tier-test", node))
        assert "step-0000000006" in held and all(int(d[5:]) <= 6 for d in held), (node, held)
    out = run_ranks(managed, 4, base, root, 2, 6, True, remote, timeout=120)
    assert [o[:2] for o in out] == [(6, True)] * 4
    shutil.rmtree(os.path.join(base, "tier-test"))
    out = run_ranks(managed, 4, base, root, 2, 6, True, remote, timeout=120)
    assert [o[:2] for o in out] == [(4, True)] * 4


def test_a_node_that_missed_a_rollback_never_brings_the_abandoned_run_back(base, tmp_path):
    """Run 1 on nodes a and b to step 25 (memory: 25 on both); node b is out while the job, on node a alone, rolls
    back to 10 and goes on to 22; node b rejoins with its memory: the restore takes run 2's 22, never run 1's 25
    (the rollback is recorded in the root's BRANCHES, and every copy says which epoch saved it)."""
    from multiproc._rollback_ranks import run

    root = str(tmp_path / "root")
    assert [o["memory"] for o in run_ranks(run, 2, base, root, ["a", "b"], 1, None, 25, timeout=150)] == [[25]] * 2
    out = run_ranks(run, 1, base, root, ["a"], 2, 10, 22, timeout=150)
    assert out == [{"restored": 10, "run": 1, "memory": [22]}]
    out = run_ranks(run, 2, base, root, ["a", "b"], 3, None, -1, timeout=150)
    assert [(o["restored"], o["run"]) for o in out] == [(22, 2)] * 2, out


def test_a_rollback_refused_for_a_pinned_step_changes_nothing_on_any_node(base, tmp_path):
    from multiproc._rollback_ranks import pinned

    out = run_ranks(pinned, 2, base, str(tmp_path / "root"), ["a", "b"], timeout=150)
    for o in out:
        assert "step(s) [20] are pinned" in o["raised"], o
        assert o["memory_before"] == o["memory_after"] == [25] and o["root_after"] == [0, 10, 20], o
        assert o["again"] == 25
