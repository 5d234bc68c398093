"""Recovery of the per-step log (``tiers.steplog.StepLog.recover``): after the newest full checkpoint K is restored,
every rank lists the records its node holds, the ranks agree on the newest step N whose records K+1..N are all held
by some live node, fetch what their node lacks from a holder, check every record, replay K+1..N through the live
optimizers with the hooks off, and load record N's rest of the state (docs/STEPLOG.md)."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch

from liferaft.errors import CorruptCheckpointError, LiferaftError
from liferaft.state import optsteps
from liferaft.tiers.stepcheck import check_own, check_records, replay_record
from liferaft.tiers.steplist import home_of, list_node
from liferaft.tiers.stepplan import bytearray_np, fetch_plan, newest_chain
from liferaft.tiers.steprecord import Header, fill_held, read_record
from liferaft.tiers.steprest import restore_rest

StepLog = Any       # (a tiers.steplog.StepLog: not imported, which imports this module)


def recover(log: StepLog, state: Any, full: int) -> int:
    """Replay the records after the full checkpoint ``full`` (just restored into ``state``); return the step
    the state is now at. Collective: three small exchanges (listing, fetch errors, check outcome) plus the
    records a rank's node lacks, sent by a holder; the replay itself is local. Each record is read once and
    verified once; the gradients are replayed from views into the record's bytes; the rest of the state is
    loaded once, from the last record. ``last_recovery`` says what it did and how long each phase took."""
    clock = [time.perf_counter()]
    log.wait()
    log.discard()
    log.attach(state, again=True)
    log._rebase(full)
    kept: dict[int, tuple[Header, bytearray, str]] = {}     # this rank's own records, read and verified
    listing = log.coord.run(lambda: _list(log, full, kept), "step log (listing)")
    refused = sorted({v[0] for held in listing for k, v in held.items() if k[0] < 0})
    listing = [{k: v for k, v in held.items() if k[0] >= 0} for held in listing]
    n, why = newest_chain(listing, full, log.world)
    newest = max((s for held in listing for (r, s) in held), default=full)
    if not why and newest > n:          # a gap: never silent
        lacking = [r for r in range(log.world) if not any((r, n + 1) in held for held in listing)]
        why = f"no node holds the record of step {n + 1} of rank(s) {lacking} (records up to step {newest} " \
              "are held; a step without maybe_save, a lost node and its replica, or a process killed while its " \
              "record was written: on a GPU, in the background after maybe_save)"
    plan = [] if n <= full else fetch_plan(listing, log.nodes, full, n)
    clock.append(time.perf_counter())
    records: dict[int, Any] = {}        # (kept on this rank: only the outcome is exchanged, not the bytes)
    log.coord.run(lambda: records.update(_gather(log, kept, plan, full, n)), "step log (fetch)")
    clock.append(time.perf_counter())
    outcome = check_own(records, full, n, log.rank, log.owner, log.world, log.layout)
    if outcome == ("ok",):
        outcome = check_records(records, state, log.optimizers or [], log.allow_pickle, full, n)
    clock.append(time.perf_counter())
    outcomes = log.coord.exchange(outcome, None, "step log (check)")
    layout = [o[1] for o in outcomes if o[0] == "layout"]
    bad = [o for o in outcomes if o[0] == "bad"]
    if layout:
        why = f"the per-step log was written by another layout ({layout[0]}); it replays only into the " \
              "layout that wrote it"
        n = full
    elif bad:
        n = min(o[2] for o in bad) - 1
        why = "; ".join(o[1] for o in bad)
    if refused and not layout:
        why = "; ".join([why] * bool(why) + refused)
    if why:
        warnings.warn(f"liferaft: the per-step log resumes at step {n} instead of past it: {why}", stacklevel=4)
    clock.append(time.perf_counter())
    rest_loads = 0
    failed: tuple[int, str] | None = None      # a record the checks passed that its replay still fails on
    at = full
    log._replaying = True
    try:
        for at in range(full + 1, n + 1):
            replay_record(*records[at], log.optimizers or [], log.allow_pickle)
        clock.append(time.perf_counter())
        if n > full:
            header, data = records[n]
            restore_rest(state, header.doc["rest"], memoryview(data), header,
                         optsteps.tensor_ids(log.optimizers or []), log.allow_pickle)
            rest_loads += 1
    except Exception as e:  # noqa: BLE001 - reported on every rank below, with the records from it removed
        failed = (at, f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        log._replaying = False
    records.clear()
    clock.append(time.perf_counter())
    fails = [(f, r) for r, f in enumerate(log._forget_collectively(n, "step log (forget the future)", failed)) if f]
    if fails:
        _replay_failed(log, fails)
    log.ring.listed = n if n > full else None       # (records full+1..n: needed until a newer full checkpoint)
    log._expect = n + 1
    clock.append(time.perf_counter())
    phases = ("listing", "fetch", "check", "agree", "replay", "rest", "forget")     # (clock's intervals)
    log.last_recovery = {"full": full, "replayed_to": n, "replayed": max(0, n - full),
                          "fetched": sum(1 for p in plan if p[2] == log.rank), "rest_loads": rest_loads,
                          "why": why, "timings": {k: b - a for k, a, b in zip(phases, clock, clock[1:])}}
    return n


def _replay_failed(log: StepLog, fails: list[tuple[tuple[int, str], int]]) -> None:
    """A record that passed every check failed in its replay (or the load of its rest of the state) on the ranks
    of ``fails`` ((step, why), rank): the live state holds part of a step, which no later step repairs (and maybe
    optimizer state the full checkpoint has none for: a load into it is refused). The records from the first such
    step on are removed on every node (collective), and every rank raises: a ``restore`` into a state made anew
    resumes at the step before it."""
    k = min(f[0] for f, _ in fails)
    log._forget_collectively(k - 1, "step log (forget the records from the one whose replay failed)")
    log.ring.listed = None
    log._expect = None
    shown = "; ".join(f"rank {r}, step {f[0]}: {f[1]}" for f, r in fails[:4])
    raise CorruptCheckpointError(f"liferaft: the replay of the per-step log failed ({shown}); the live state holds "
                                 f"part of a replayed step (optimizer state included) and must not be trained on. "
                                 f"The records from step {k} on are removed from every node: make the state anew "
                                 f"(model and optimizers, as at the start of the run) and call restore on it; it "
                                 f"resumes at step {k - 1} at most")


def _list(log: StepLog, full: int, kept: dict[int, tuple[Header, bytearray, str]]) -> dict[tuple[int, int],
                                                                                         tuple[str, int, int]]:
    """``steplist.list_node`` for this rank; notes the slots of its own records and the held replicas."""
    got = list_node(log.root, log.nodes, log.rank, log.world, log.owner, full, kept, log.live)
    log._thin = got.thin
    log.ring.held.update(got.slots)
    return got.records


def _gather(log: StepLog, kept: dict[int, tuple[Header, bytearray, str]], plan: list[tuple[int, int, int, str, int]],
            full: int, n: int) -> dict[int, tuple[Header | None, Any, str]]:
    """This rank's records full+1..n as (header if verified already, bytes, where): its own, read by ``_list``,
    or received per ``plan`` (step, holder, rank, slot name, length) — and then kept in its node's ring too.
    A record this rank cannot serve (read or fill failed since the listing) goes as zeros, refused by the
    receiver's check: its peer never waits out a timeout for it."""
    works, got = [], {}
    for tag, (step, holder, rank, rel, length) in enumerate(plan):
        if holder == log.rank:
            try:
                raw = read_record(log.root, rel, length)
                held = log._thin.get(rel)
                home = home_of(log.root, log.rank, held, kept) if held is not None else None
                if held is not None:            # the gradients a record of this node holds
                    if home is None:
                        raise CorruptCheckpointError(f"{rel}: the record its held gradients are in is gone")
                    fill_held(raw, held, home, os.path.join(log.root, rel))
            except (LiferaftError, OSError) as e:
                warnings.warn(f"liferaft: cannot send the step record {rel} to rank {rank}: {e}", stacklevel=2)
                raw = bytearray(length)
            data = torch.from_numpy(bytearray_np(raw))
            works.append(log.coord.isend(data, rank, tag))
        if rank == log.rank:
            buf = torch.empty(length, dtype=torch.uint8)
            works.append(log.coord.irecv(buf, holder, tag))
            got[step] = (buf, rel)
    for w in works:
        w.wait()
    out: dict[int, tuple[Header | None, Any, str]] = {}
    for step in range(full + 1, n + 1):
        if step in got:
            buf, rel = got[step]
            data = memoryview(buf.numpy())
            log._store(rel, data)
            log.ring.held[int(rel.rsplit("-", 1)[1])] = step
            out[step] = (None, data, os.path.join(log.root, rel) + " (from a peer)")
        else:
            out[step] = kept[step]
    return out


__all__ = ["recover"]
