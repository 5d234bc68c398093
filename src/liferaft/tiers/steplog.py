"""The per-step log: every optimizer step recoverable between full checkpoints (docs/STEPLOG.md).

After every training step each rank appends one step record (``tiers.steprecord``) to its node's shared memory —
the gradients each ``optimizer.step()`` consumed, the hyperparameters and keyword arguments it ran with, and the
rest of the state after the step (``tiers.steprest``) — into a preallocated ring of ``max_steps`` slot files, and
a background thread sends it to ``replicas`` ranks on other nodes (the same local position on the next nodes, as
the memory tier places its replicas). Before the next record is published the previous one is replicated, so
losing a node's memory loses at most one step.

Recovery (collective, after the newest full checkpoint K is restored): every rank lists the records its node
holds (exchanged), the ranks agree on the newest N such that records K+1..N of every rank are held by some live
node, fetch what their node lacks from a holder, check every record (checksums, and the layout it was written by:
a different world size or layout replays nothing and warns), replay K+1..N through the live optimizers with the
hooks off, and load record N's rest of the state. A damaged record stops the replay at the step before it, with
a warning naming the file. Records at or below the newest durable full checkpoint are free (their slots reused).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from liferaft.codecs.checksum import digest, stream
from liferaft.dist import Coordinator
from liferaft.errors import InvalidStateError, LiferaftError
from liferaft.state import optsteps
from liferaft.state.values import encode_value
from liferaft.tiers import namespace, steprecover
from liferaft.tiers.memory import MemoryTier
from liferaft.tiers.stepcheck import lock_writer, owner_id
from liferaft.tiers.stepcuda import Copy, CudaCopies
from liferaft.tiers.steplist import own_slots, rank_dir, records_after, remove_after, slot_name
from liferaft.tiers.stepplan import (
    AUTO_MAX,
    AUTO_MIN,
    AUTO_SHARE,
    ring_size,
    targets,
)
from liferaft.tiers.steprecord import (
    FORMAT,
    HELD,
    PROLOGUE,
    RECORD_CHECKSUM,
    Held,
    as_bytes,
    encode_header,
    entry_of,
    prologue,
    tensor_entry,
)
from liferaft.tiers.steprest import RestCapture
from liferaft.tiers.stepring import Ring
from liferaft.tiers.stepsend import Sender
from liferaft.tiers.stepshare import ReplayShare
from liferaft.tiers.stepslot import Slot as _Slot

ALIGN = 64
_STREAMED = 1 << 20     # a tensor of at least this many bytes is copied and hashed in pieces of _PIECE
_PIECE = 256 << 10


class StepLog:
    """The per-step log of one manager (collective: every rank constructs it and makes the same calls).

    ``memory`` gives the node's shared-memory namespace and the nodes; ``replicas`` copies of each record go to
    ranks on other nodes; the ring holds ``max_steps`` records per rank (``full`` says when the next record would
    need a slot still holding a record newer than the newest durable full checkpoint: the manager then saves one).
    """

    def __init__(self, memory: MemoryTier, *, replicas: int, max_steps: int | None, process_group: Any = None,
                 timeout: float = 600.0, allow_pickle: bool = False, owner: str = "") -> None:
        self.memory, self.replicas = memory, replicas
        #: the ring's bookkeeping; its size None given: sized by ``stepplan.ring_size`` at the first record
        self.ring = Ring(max_steps)
        self._last_len = 0                          # the last record's length (its slot's reservation)
        self._scanned = False                       # whether this run's first record looked for stale slots
        self.allow_pickle = allow_pickle
        self.owner = owner_id(owner)
        self.root = os.path.join(memory.root, "steplog", self.owner)
        os.makedirs(self.root, exist_ok=True)
        self.coord = Coordinator(process_group, timeout, channel="steplog")
        self.bg = Coordinator(process_group, timeout, channel="steplog-bg")     # used by the replication thread
        self.rank, self.world, self.nodes = self.coord.rank, self.coord.world, memory.nodes
        # one live writer per rank of this namespace (its lock apart from the namespace, which a release removes)
        self._writer = lock_writer(os.path.join(memory.locks, "steplog", self.owner), rank_dir(self.rank))
        self.targets = targets(self.nodes, self.rank, replicas)
        self.sources = [r for r in range(self.world) if self.rank in targets(self.nodes, r, replicas)]
        self.optimizers: list[torch.optim.Optimizer] | None = None
        self.layout = ("", "")
        self._hooks: list[Any] = []
        self._replaying = False
        self._files: dict[str, _Slot] = {}      # rel -> open slot file (own ring and replicas)
        self._cur: dict[str, Any] | None = None   # the record being captured
        self._diverged_at: int | None = None        # restore(step=K): records > K dropped at the next record
        #: the manager's rollbacks so far (every record says how many: ``epoch``), and whether a record of ``step``
        #: written at ``epoch`` belongs to its run (``manager.rollback.live``; set by the manager)
        self.epoch = 0
        self.live: Callable[[int, int], bool] = lambda step, epoch: True
        self._expect: int | None = None             # the step the next record should be of (None: unknown)
        #: a failed record's (step, calls, plain entries) still in the record being written: kept for a retry of
        #: that step, dropped by the record of any other step (``_failed``)
        self._stale: tuple[int, int, int] | None = None
        self._skipped: int | None = None            # the last step whose replication exchange was held empty
        #: a gradient's copy that failed in the step hook (``_capture``): the record being written misses a step
        self._broken: Exception | None = None
        self._unrecorded: int | None = None         # a step whose record cannot be made (its capture broke)
        self._cuda = CudaCopies()                # the CUDA tensors' copies (tiers.stepcuda)
        self._gen = 0                            # the pinned generation of the next record (records alternate)
        #: the record the background is publishing (cur, doc, copies, replicate): published again by ``wait``
        #: if that fails
        self._publishing: tuple[dict[str, Any], dict[str, Any], list[Copy], bool] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="liferaft-steplog")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self._rest = RestCapture()
        self._thin: dict[str, Held] = {}        # (a recovery's listing) replica slot -> its held trailer
        self._sender = Sender(self.root, self.bg, self.rank, self.targets, self.sources, slot_name, self._slot)
        self._share = ReplayShare()             # what a replay costs, as a share of the training time (measured)
        #: what the last recovery did (docs/STEPLOG.md): {"full", "replayed_to", "replayed", "fetched",
        #: "rest_loads", "why", "timings" (seconds per phase)} (for logs and tests)
        self.last_recovery: dict[str, Any] = {}

    # ------------------------------------------------------------------ capture

    def attach(self, state: Any, again: bool = False) -> bool:
        """Find the optimizers in ``state`` and hook them (once); True if this call attached. ``again`` (a restore:
        the state may be made anew, e.g. after a restore that raised): if ``state``'s optimizers are other objects
        than the hooked ones, those are unhooked and these hooked."""
        if self.optimizers is not None:
            if not again:
                return False
            found = optsteps.find_optimizers(state)
            if [id(o) for o in found] == [id(o) for o in self.optimizers]:
                return False
            for h in self._hooks:
                h.remove()
            self._hooks, self.optimizers = [], None
        self.optimizers = optsteps.find_optimizers(state)
        self.layout = optsteps.layout_of(self.optimizers, self.world)
        self._hooks = optsteps.hook_optimizers(self.optimizers, self._capture)
        return True

    def _capture(self, index: int, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Step pre-hook: copy what this ``step()`` consumes into the record being written. A copy that fails (a
        full /dev/shm, no pinned memory: on this rank alone, maybe) does not stop the step — its peers take
        theirs — but breaks the record: ``record`` raises it (``_broken``). What every rank meets alike (a closure,
        sparse gradients: InvalidStateError) is raised here, before the step."""
        if self._replaying or self._broken is not None:
            return
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:   # (args[0]: the optimizer)
            raise InvalidStateError(f"{type(opt).__qualname__}.step() was given positional arguments (a closure?): "
                                    "the per-step log replays steps without closures (docs/STEPLOG.md)")
        self._share.step(time.perf_counter())
        try:
            cur = self._begin()
        except Exception as e:  # noqa: BLE001 - raised by record(), after the step (this rank's alone, maybe)
            self._broken = e
            return
        pos, n_plain, n_cuda = cur["pos"], len(cur["plain"]), len(self._cuda.pending)
        try:
            grads = []
            for p in optsteps.params_of(opt):
                g = p.grad
                if g is not None and g.layout != torch.strided:
                    raise InvalidStateError(f"{type(opt).__qualname__}.step(): a gradient is {g.layout} (an "
                                            "nn.Embedding(sparse=True)?): the per-step log records dense gradients "
                                            "only (docs/STEPLOG.md); use dense gradients or no step_log")
                grads.append(None if g is None else self._put(optsteps.local_of(g).detach()))
                # a plain gradient may be the same bytes on every rank (DDP): the peer may hold it already
                cur["plain"].append(grads[-1] if g is not None and not optsteps.is_dtensor(g) else None)
            groups = [{k: self._value(v, k) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            call = {"opt": index, "grads": grads, "groups": groups,
                    "kwargs": {k: self._value(v, k) for k, v in kwargs.items() if k != "closure"}}
            attrs = optsteps.amp_attrs(opt)     # GradScaler's grad_scale/found_inf on a fused optimizer
            if attrs:
                call["attrs"] = {k: self._value(v, k) for k, v in attrs.items()}
        except BaseException as e:
            # (nothing of this step() stays in the record, whose space is asked for again next time; it runs only
            # if the copy failed for want of room: the record is broken then)
            self._cuda.fence(n_cuda)
            cur["pos"] = pos
            del cur["plain"][n_plain:]
            self._cuda.drop(n_cuda)
            if isinstance(e, InvalidStateError) or not isinstance(e, Exception):
                raise
            self._broken = e
            return
        self._cuda.fence(n_cuda)       # (the optimizer's kernels, or one changing its gradients, wait for the copies)
        cur["calls"].append(call)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The hooks ignore the optimizer steps run inside: liferaft's own saves and loads (torch's state-dict
        helpers run a placeholder step, with zero gradients, on an optimizer that never stepped: not a training
        step, and a record of it would stop every later replay)."""
        was, self._replaying = self._replaying, True
        try:
            yield
        finally:
            self._replaying = was

    def _value(self, v: Any, key: str) -> Any:
        if isinstance(v, torch.Tensor):
            return {"$t": self._put(optsteps.local_of(v).detach())}
        return encode_value(v, key, self.allow_pickle)

    def _begin(self) -> dict[str, Any]:
        if self._cur is None:
            slot = self._free_slot()
            rel = slot_name(self.rank, slot)
            f = self._file(rel)
            # (sized once to the last record, as a ring's records are alike: no doubling up to it, no room past it)
            f.reserve(max(PROLOGUE, self._last_len), whole=self._last_len > 0)
            f.write(0, bytes(PROLOGUE))                  # no record in this slot until the new prologue
            self.ring.held.pop(slot, None)
            self._cur = {"slot": slot, "file": f, "pos": PROLOGUE, "calls": [], "plain": [], "gen": self._gen}
            self._gen ^= 1
        return self._cur

    def _file(self, rel: str) -> _Slot:
        with self._lock:                    # (the replication thread opens slots too)
            f = self._files.get(rel)
            if f is None:
                f = self._files[rel] = _Slot(self.root, rel)
            return f

    def _free_slot(self) -> int:
        """The slot for the next record (``Ring.free_slot``); a record dropped for it is warned about."""
        slot, dropped = self.ring.free_slot()
        if dropped is not None:
            self._share.spoil(max(self.ring.held.values()))
            warnings.warn(f"liferaft: the per-step log's ring ({self.max_steps} steps) is full; dropping the record "
                          f"of step {dropped} (a recovery now resumes from the full checkpoint)", stacklevel=4)
        return slot

    def _put(self, t: torch.Tensor) -> dict[str, Any]:
        """Store tensor ``t`` at the record's next offset; its header entry (CUDA: copied to pinned memory on a side
        stream now, written and hashed when the record is published, in the background)."""
        cur = self._cur
        assert cur is not None
        off = cur["pos"]
        n = t.numel() * t.element_size()
        end = off + (n + ALIGN - 1) // ALIGN * ALIGN
        cur["file"].reserve(end)                # (first: a reservation that fails takes no room)
        cur["pos"] = end
        if t.is_cuda:
            self._share.blind = True
            return self._cuda.enqueue(t, off, cur["gen"])
        src = t.cpu()
        src = src if src.is_contiguous() else src.contiguous()
        data = as_bytes(src)
        if n >= _STREAMED:
            # copied and hashed piece by piece: each piece is hashed while it is still in the CPU's cache (one
            # pass over memory, not two: 13 MiB of DDP gradients 1.41 -> 1.19 ms here). Both hold the GIL, on
            # purpose: a copy that let it go per piece (numpy's, Slot.copy_in) could wait to get it back behind a
            # background thread's Python, up to a switch interval per piece (suspected from one noisy run, not
            # confirmed: holding it costs nothing on the training thread)
            h, f = stream(RECORD_CHECKSUM), cur["file"]
            for i in range(0, n, _PIECE):
                part = data[i:i + _PIECE]
                f.write(off + i, part)
                h.update(part)
            return entry_of(off, src, n, h.hexdigest())
        cur["file"].write(off, data)
        return tensor_entry(off, src, data)

    def record(self, step: int, state: Any) -> None:
        """Publish the record of ``step`` (after the step; the manager's ``maybe_save``): the captured calls plus
        the rest of ``state``, then replicate it in the background once the previous record is replicated.

        A record with CUDA tensors is published in the background too: the training thread only enqueues their
        copies (on a side stream, into pinned memory) and returns; the replication thread waits for the copies,
        writes and hashes them, then writes the header and the prologue. The next ``record`` waits for both, as
        for the replication, so a killed process loses at most the step it had just recorded (its slot's
        prologue is written last: a record cut short is no record)."""
        if self.attach(state):
            return                          # hooked just now: this step's calls were not seen
        if self._cur is None and step in (self.ring.recorded, self._unrecorded):
            return                          # maybe_save called again for the same step: recorded already (or never)
        if self._stale is not None and self._stale[0] != step and self._cur is not None:
            _, calls, plain = self._stale   # (a failed record's optimizer step: not this record's)
            del self._cur["calls"][:calls]
            del self._cur["plain"][:plain]
        self._stale = None
        self._share.record(time.perf_counter())
        try:
            self.wait()                     # the previous record is on its replicas (≤ 1 step lost with a node)
            self.go_on()
            if self._broken is not None:
                raise self._broken          # (an optimizer step of it was not captured: no record of it can be)
            if self._expect is not None and step > self._expect:
                self._share.spoil(step)
                gap = f"{self._expect}" if step == self._expect + 1 else f"{self._expect}..{step - 1}"
                warnings.warn(f"liferaft: maybe_save was not called for step {gap}: the per-step log's record of "
                              f"step {step} holds those optimizer steps too, and a recovery stops at the gap (step "
                              f"{self._expect - 1}) until the next full checkpoint; call maybe_save after every "
                              "step (docs/STEPLOG.md)", stacklevel=3)
            self._expect = step + 1
            cur = self._begin()
            live = optsteps.LiveIds(self.optimizers or [])  # (found only if the walk meets a tensor: most steps not)
            n_cuda = len(self._cuda.pending)
            with self.suspended():      # (the full walk's get_optimizer_state_dict runs a placeholder step on an
                #                           optimizer without state, e.g. plain SGD: no call of this record)
                rest = self._rest.capture(state, live, self._put, self.allow_pickle)
            self._cuda.fence(n_cuda)    # the rest's CUDA tensors (buffers): read before the next forward changes them
            if self.ring.auto:         # (at least every parameter's gradient: a first step GradScaler skipped has
                #                           none)
                grads = sum(optsteps.local_of(p).numel() * optsteps.local_of(p).element_size()
                            for opt in self.optimizers or [] for p in optsteps.params_of(opt))
                self._size_ring(max(cur["pos"], PROLOGUE + grads))
            if not self._scanned:       # (this run's first record: a last run's slots past this ring go)
                self._scanned = True
                self._trim(scan=True)
            cuda = self._cuda.take()
            doc = {"format": FORMAT, "checksum": RECORD_CHECKSUM, "step": step, "rank": self.rank,
                   "world": self.world, "owner": self.owner, "epoch": self.epoch, "layout": self.layout[0],
                   "calls": cur["calls"], "rest": rest}
            length = 0 if cuda else self._publish(cur, doc, cuda)     # (CPU: published before anything is noted)
        except BaseException:
            self._failed(step)
            raise
        # (a retry of a failed record whose exchange was held empty: kept here only, the peers' exchanges in step)
        replicate = bool(self.targets or self.sources) and self._skipped != step
        self.ring.held[cur["slot"]] = step
        self._cur, self.ring.recorded = None, step
        if replicate or cuda:
            self.ring.busy = cur["slot"]        # (read or written in the background: not reused until it is done)
        if not cuda:
            if replicate:
                self._pending = self._pool.submit(self._replicate, cur["slot"], step, length, cur["plain"])
            return
        self._publishing = (cur, doc, cuda, replicate)
        self._pending = self._pool.submit(self._publish_then_replicate, cur, doc, cuda, replicate)

    def _failed(self, step: int) -> None:
        """``record(step)`` raised, maybe on this rank alone (a full /dev/shm, a value it cannot encode): this rank
        has no record of ``step``. What its peers do for the step still happens here, so that the ranks' exchanges
        stay in step: the auto ring's size vote (this rank votes for nothing smaller), and, with replicas, the
        step's replication exchange, with nothing sent (the peers' records still received and kept) — unless the
        replication before it is still in flight (an interrupted wait: the exchanges then stay one apart, and
        the peers' next wait fails at their timeout). A recovery stops before ``step`` (the chain has a hole)
        until a full checkpoint, which ``save_due`` asks for at once. The calls captured for it stay for a retry of
        ``step`` (recorded then, on this node only when its exchange was held empty); the record of any other step
        drops them (kept, a full checkpoint of ``step`` followed by the next record would replay them twice)."""
        self.ring.lost = step if self.ring.lost is None else max(self.ring.lost, step)
        self._share.spoil(step)
        cur = self._cur
        self._stale = (step, len(cur["calls"]), len(cur["plain"])) if cur is not None else None
        if self._broken is not None:        # (a capture broke: what the record holds is no step, not even on retry)
            self._broken, self._unrecorded, self._stale = None, step, None
            if cur is not None:
                self._cuda.drop(0)
                # (its pinned generation reused: the record before it may still be drained from the other one, a
                # wait for it interrupted)
                self._cur, self._gen = None, cur["gen"]
        self._expect = step + 1
        if (self.targets or self.sources) and self._pending is None and self._skipped != step:
            # (once per step: a retry that fails again holds no second exchange, as the peers' retry holds none)
            self._pending = self._pool.submit(self._sender.skip, RECORD_CHECKSUM)
            self._skipped = step
        if self.ring.auto:
            self._size_ring(None)

    def _size_ring(self, record_bytes: int | None) -> None:
        """``max_steps="auto"``: the ring's size from this first record's length (``stepplan.ring_size``), the
        smallest any rank found (collective: every rank's first record is of the same ``maybe_save``; None: this
        rank's record failed, it votes for nothing smaller). One size on every rank: a ring voted full is then
        full on every rank once the save in flight is done, and every rank takes the same synchronous save
        (``manager._decide``)."""
        self.ring.auto = False
        try:
            st = os.statvfs(self.root)
            shm = st.f_blocks * st.f_frsize
        except OSError:
            shm = 0
        here = sum(n == self.nodes[self.rank] for n in self.nodes)
        files = _descriptor_limit()
        size, fits = ring_size(record_bytes or 0, shm, here, len(self.sources), files) if record_bytes is not None \
            else (AUTO_MAX, True)
        self.ring.size = -self.coord.all_max([-size], "step log (ring size)")[0] if self.world > 1 else size
        if not fits:
            warnings.warn(f"liferaft: the per-step log's records of rank {self.rank} take "
                          f"{(record_bytes or 0) / 2 ** 20:.2f} MiB "
                          f"each: {AUTO_MIN} of them, with the replicas kept for {len(self.sources)} other rank(s), "
                          f"for each of the {here} rank(s) of this node, take more than 1/{AUTO_SHARE} of its "
                          f"shared memory ({shm >> 20} MiB at {self.memory.root}); the ring holds {AUTO_MIN} "
                          "all the same (a full checkpoint every few steps). Give /dev/shm more room (docker: "
                          "--shm-size), or shard the gradients (FSDP), or set StepLogOptions.max_steps "
                          "(docs/STEPLOG.md)", stacklevel=4)

    @property
    def replay_share(self) -> float | None:
        """About what replaying a record costs, as a share of the time training took to make it (measured on the
        live steps: from the first optimizer step's capture to ``maybe_save``, against the time between records;
        smoothed; None before two records, while the chain since the last full checkpoint has a hole, and with
        CUDA records): the part of the work since the last full checkpoint that a failure the log covers still
        costs (``tiers.stepshare``). The manager's memory-tier interval
        (``memory_every="auto"``) uses it."""
        return self._share.value

    def _publish(self, cur: dict[str, Any], doc: dict[str, Any], cuda: list[Copy]) -> int:
        """Write the record ``cur``: its CUDA tensors' copies, the header ``doc``, the prologue last. Its length."""
        f: _Slot = cur["file"]
        self._cuda.drain(f, cuda, cur["gen"])   # (before the header: it fills their entries)
        header = encode_header(doc)
        off = cur["pos"]
        f.reserve(off + len(header))
        f.write(off, header)
        f.write(0, prologue(off + len(header), off, len(header), digest(header)))
        self._last_len = off + len(header)
        return off + len(header)

    def _publish_then_replicate(self, cur: dict[str, Any], doc: dict[str, Any], cuda: list[Copy],
                                replicate: bool) -> None:
        """Background (a record with CUDA tensors): publish it, then replicate it. A failure is raised by the next
        ``wait``, which then forgets the record if it was not published."""
        try:
            length = self._publish(cur, doc, cuda)
        except BaseException:
            self.ring.busy = -1
            raise
        self._publishing = None
        if replicate:
            self._replicate(cur["slot"], doc["step"], length, cur["plain"])     # (frees ring.busy when done)
        else:
            self.ring.busy = -1

    @property
    def max_steps(self) -> int:
        """The ring's size (``Ring.size``)."""
        return self.ring.size

    @property
    def durable(self) -> int:
        """The newest durable full checkpoint's step (``Ring.durable``)."""
        return self.ring.durable

    @property
    def full(self) -> bool:
        """``Ring.full``: every slot holds a record newer than the newest durable full checkpoint."""
        return self.ring.full

    def full_after_next(self, durable: int | None = None) -> bool:
        """``Ring.full_after_next``: full once one more record is published (a save of ``durable`` counted)."""
        return self.ring.full_after_next(durable)

    @property
    def save_due(self) -> bool:
        """``Ring.save_due``: whether the manager should start an asynchronous full checkpoint now."""
        return self.ring.save_due

    def mark_durable(self, step: int) -> None:
        """A full checkpoint of ``step`` is durable: records up to it are free (their slots reused)."""
        self.ring.mark_durable(step)
        self._share.durable(step)
        self._trim()

    def _trim(self, scan: bool = False) -> None:
        """Remove this rank's slot files past the ring whose record is at or below the durable step (a restart
        into a smaller ring left them): the ring never takes them again, their memory goes back to the node.
        ``scan``: also those past the ring holding no record a recovery listed (the ring's sizing: a last run's
        slots whose records were at or below its full checkpoint, or never published)."""
        for s in self.ring.past(own_slots(self.root, self.rank) if scan else [], self._cur["slot"] if self._cur else None):
            rel = slot_name(self.rank, s)
            with self._lock:
                f = self._files.pop(rel, None)
            if f is not None:
                f.close()
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.root, rel))

    def _rebase(self, step: int) -> None:
        """The state now stands on the full checkpoint ``step`` (restored): it is the newest base of this run's
        records, even where a newer one was durable before (a rollback removed it, or it did not load): records
        after ``step`` are kept until a newer full checkpoint is durable, never reused as if covered by the old
        one. The replay share is measured afresh."""
        self.ring.durable = step
        self._share = ReplayShare()

    def held_steps(self) -> list[int]:
        """Steps of this rank's records that a recovery could still need (newer than the durable checkpoint)."""
        return self.ring.held_steps()

    def wait(self) -> None:
        """Wait for the replication (and a background publish) in flight; raise what it raised. A record whose
        background publish failed is published again here (its pinned copies are still whole: the next record
        uses the other generation); if that fails too, the record is forgotten and the error says which step a
        recovery now stops before (until the next full checkpoint, which ``save_due`` then asks for at once).
        Interrupted while waiting (Ctrl-C), the work stays in flight and is waited for by the next call."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as e:
            if not pending.done():
                raise                       # interrupted: still running, waited for again (close waits too)
            self._pending = None
            publishing, self._publishing = self._publishing, None
            if publishing is None or pending.exception() is None:
                raise                       # (a failed replication; or an interruption just as it finished)
            self._publish_again(publishing, e)
            return
        self._pending, self._publishing = None, None

    def _publish_again(self, publishing: tuple[dict[str, Any], dict[str, Any], list[Copy], bool],
                       first: BaseException) -> None:
        """The background publish of a record failed with ``first``: publish (and replicate) it here, or forget
        it and raise ``first`` naming the step lost."""
        cur, doc, cuda, replicate = publishing
        try:
            length = self._publish(cur, doc, cuda)
        except BaseException as e:      # (interrupted too: the record is not whole)
            self.ring.held.pop(cur["slot"], None)
            self.ring.lost = doc["step"]
            self._share.spoil(doc["step"])
            if not isinstance(e, Exception):
                raise
            if replicate:           # (the step's exchange, with nothing sent: the peers' stay in step with this one)
                self._skipped = doc["step"]
                with contextlib.suppress(LiferaftError):
                    self._sender.skip(RECORD_CHECKSUM)
            first.add_note(f"liferaft: the per-step record of step {doc['step']} was not published ({e}); until "
                           f"the next full checkpoint, a recovery resumes at step {doc['step'] - 1} at the latest")
            raise first from None
        if replicate:
            self.ring.busy = cur["slot"]
            self._replicate(cur["slot"], doc["step"], length, cur["plain"])     # (frees ring.busy)

    # ------------------------------------------------------------------ replication

    def _replicate(self, slot: int, step: int, length: int, plain: list[dict[str, Any] | None]) -> None:
        """Background: send this rank's record in ``slot`` to its targets, less the plain gradients a target's own
        record of the step holds (``tiers.stepsend``); store the sources' records."""
        try:
            self._sender.run(slot, step, length, plain, RECORD_CHECKSUM)
        finally:
            self.ring.busy = -1
        # the slot the next record will likely take gets its pages now, off the training thread (a slot's pages
        # are allocated once: until the ring has gone round once, every record takes a fresh slot)
        nxt = self.ring.next_free(slot)
        if nxt is not None:
            try:
                self._file(slot_name(self.rank, nxt)).reserve(length, whole=True)
            except OSError:
                pass                        # (the record's own reservation reports it)

    def _slot(self, rel: str, size: int, holes: Sequence[tuple[int, int]] = ()) -> _Slot:
        f = self._file(rel)
        f.reserve(size, whole=True, holes=holes)
        return f

    def _store(self, rel: str, data: memoryview) -> None:
        """Write a whole record (received from a peer) into the slot file ``rel``: the prologue last (a held
        trailer an earlier replica left there zeroed: this copy is whole)."""
        f = self._file(rel)
        f.reserve(len(data) + len(HELD), whole=True)
        f.write(0, bytes(PROLOGUE))
        f.write(len(data), bytes(len(HELD)))
        f.write(PROLOGUE, data[PROLOGUE:])
        f.write(0, data[:PROLOGUE])

    # ------------------------------------------------------------------ recovery

    def recover(self, state: Any, full: int) -> int:
        """Replay the records after the full checkpoint ``full`` (just restored into ``state``); return the step
        the state is now at (``tiers.steprecover.recover``). Collective."""
        return steprecover.recover(self, state, full)

    def resume_at(self, state: Any, step: int) -> None:
        """The state was restored to the full checkpoint ``step`` on request (``restore(state, step=K)``): hook the
        optimizers and replay nothing. The records newer than ``step`` stay (a later ``restore()`` may still
        replay them; their slots are listed now, so that no record takes one) until this run records its first
        step: that step starts another future, so the first ``record`` drops them then (collectively).
        Collective."""
        self.wait()
        self.discard()
        self.attach(state, again=True)
        self._rebase(step)
        self.ring.held = records_after(self.root, self.rank, step)
        self.ring.listed = max(self.ring.held.values(), default=None)
        self._diverged_at = step
        self._expect = step + 1

    def discard(self) -> None:
        """Forget the record being captured (a restore: the optimizer steps taken before it are not this run's;
        a record holding them would replay them)."""
        if self._cur is not None:
            self._cuda.drop(0)
            self._cur, self._gen = None, self._cur["gen"]   # (the generations alternate from the last record's)
        # (a step number before the restore names another step after it: retried, held or recorded, none is it)
        self._stale = self._skipped = self.ring.recorded = self._broken = self._unrecorded = None

    def go_on(self) -> None:
        """The run goes on after ``resume_at(K)`` (its first record, or the manager's first save): the records newer
        than K go now, collectively (every rank calls it). Nothing after any other restore."""
        if self._diverged_at is not None:
            self._forget_collectively(self._diverged_at, "step log (forget the future)")
            self._diverged_at = None

    def _forget_collectively(self, step: int, what: str, report: Any = None) -> list[Any]:
        """``_forget_after(step)`` on one rank per node, every rank waiting until every node's is done (no rank
        publishes a record the removal could take), then each rank's slot files open on a removed file closed.
        Returns every rank's ``report`` (rank order), exchanged on the way."""
        reports = self.coord.run(lambda: (self._forget_after(step), report)[1], what)
        for rel, f in list(self._files.items()):
            try:
                same = os.stat(os.path.join(self.root, rel)).st_ino == os.fstat(f.fd).st_ino
            except OSError:
                same = False
            if not same and (self._cur is None or self._cur["file"] is not f):
                f.close()
                del self._files[rel]
        return reports

    def _forget_after(self, step: int) -> None:
        """Drop this node's records newer than ``step`` (a future the resumed run does not share). Only inside
        ``_forget_collectively``."""
        self.ring.forget_after(step)
        if min(r for r, m in enumerate(self.nodes) if m == self.memory.node) == self.rank:
            remove_after(self.root, step)

    def start_fresh(self, state: Any) -> None:
        """No full checkpoint to resume from: hook ``state``'s optimizers and drop this node's records of an
        earlier run (they replay onto nothing). Collective."""
        self.wait()
        self.discard()
        self.attach(state, again=True)
        self._forget_collectively(-1, "step log (fresh start)")

    def close(self) -> None:
        """Wait for the replication, unhook, close the slot files (the records stay for a restart)."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)  # (first, even if interrupted: nothing writes a slot once it is closed)
            for h in self._hooks:
                h.remove()
            self._hooks = []
            for f in self._files.values():
                f.close()
            self._files.clear()
            if self._writer >= 0:
                namespace.let_go(self._writer)
                self._writer = -1

    def release(self) -> None:
        """Free this node's records (a clean exit of the job). Not collective."""
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _descriptor_limit() -> int | None:
    """This process's soft limit of open files (None: unknown or unlimited)."""
    try:
        import resource
    except ImportError:         # (not a POSIX host)
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else soft


__all__ = ["StepLog"]
