"""The memory tier: checkpoints in host shared memory that outlive the training process, replicated on peer nodes.

Layout: ``<base>/<job_id>/<node>/step-<n>/`` is a liferaft checkpoint (docs/FORMAT.md) in a tmpfs folder
(``/dev/shm`` by default), one namespace per node. Every rank writes its own data file into its node's namespace;
every node gets the manifest and then ``COMMIT`` (so each node's folder is a committed checkpoint whose data files
are spread over the nodes); then each rank sends its data file to ``replicas`` ranks on other nodes, which store it
under the same name in theirs. A process that crashes finds its node's copy when it restarts; a node that is lost
(its processes and its shared memory) is covered by the replicas on the other nodes.

A restore lists, on every rank, the steps its node holds and the files present (exchanged); picks the newest step
whose every data file is held by some live node; then loads it (``core.load.load_held``): each rank reads what its
node holds straight from shared memory into its tensors, and the byte ranges it needs from files only other nodes
hold are read there and sent to it (over the process group: on a real cluster a node cannot read another's shared
memory) — no file is copied, every byte is verified as it lands, any layout and world size. A namespace is per job id:
a segment of another job is never read, and whatever is read is checked against the manifest's checksums.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from liferaft.core.commit import CommitRecord, open_checkpoint, publish_commit, read_commit, read_marker
from liferaft.dist import Coordinator
from liferaft.errors import CheckpointBusyError, CorruptCheckpointError, DistributedError, LiferaftError, OptionsError
from liferaft.format.layout import COMMIT_MARKER, DATA_DIR, data_file_rank, manifest_name, parse_step, step_name
from liferaft.format.limits import MAX_INT
from liferaft.format.manifest import decode_commit_marker
from liferaft.options import LoadOptions, SaveOptions
from liferaft.storage.base import FileWriter, Storage
from liferaft.storage.files import plain_component
from liferaft.storage.posix import PosixStorage
from liferaft.tiers import namespace, parity

DEFAULT_BASE = "/dev/shm/liferaft"
PIECE = 4 << 20             # bytes per message when copying a file between ranks, and per request of a drain


def default_node() -> str:
    """This process's node: torchrun's GROUP_RANK (the node rank) when set, else the host name."""
    import socket

    group = os.environ.get("GROUP_RANK")
    return f"node{group}" if group is not None else socket.gethostname()


class MemoryTier:
    """Checkpoints of the latest step(s) in node-local shared memory plus ``replicas`` copies of every rank's data
    on other nodes. Collective: every rank of ``process_group`` constructs it and calls ``save``/``restore``.

    ``node`` identifies this process's node (default: ``default_node()``; tests give each simulated node its own
    name); ``base`` is a tmpfs folder; ``keep`` steps stay in memory (older ones are dropped once a newer one is
    complete on every node). ``bandwidth`` caps the replication traffic each rank sends (bytes/s; None: as fast as
    the network goes), so that it leaves the training's own collectives room. ``release()`` frees this node's
    memory (a clean exit). ``parity=k`` (≥ 2): XOR parity across groups of ``k`` nodes instead of replicas
    (``tiers.parity``; ``replicas`` is then 0): a node holds ``1/(k − 1)`` of its data more, and one lost node per
    group is rebuilt from the others at restore.
    """

    def __init__(self, job_id: str, *, node: str | None = None, base: str = DEFAULT_BASE, replicas: int = 1,
                 keep: int = 1, process_group: Any = None, timeout: float = 600.0,
                 bandwidth: float | None = None, parity: int = 0) -> None:
        if type(parity) is not int or parity == 1 or parity < 0:
            raise OptionsError(f"MemoryTier: parity is the number of nodes per parity group (at least 2), or 0 for "
                               f"none, got {parity!r}")
        replicas = 0 if parity else replicas
        if replicas < 0 or keep < 1 or not plain_component(job_id) or job_id == namespace.LOCKS:
            raise OptionsError(f"MemoryTier: need a job id that is one plain folder name (not '.', '..' or "
                               f"'{namespace.LOCKS}', no '/', "
                               f"'\\' or NUL), replicas ≥ 0, keep ≥ 1 (got {job_id!r}, {replicas}, {keep})")
        node = node or default_node()
        if not plain_component(node):
            raise OptionsError(f"MemoryTier: the node name must be one plain folder name (not '.' or '..', no '/', "
                               f"'\\' or NUL), got {node!r} (pass node=)")
        self.job_id, self.node, self.replicas, self.keep, self.parity = job_id, node, replicas, keep, parity
        self.process_group, self.timeout, self.bandwidth = process_group, timeout, bandwidth
        self.root = os.path.join(base, job_id, self.node)
        #: where this node's namespace locks live, apart from ``root`` (which ``release()`` removes)
        self.locks = namespace.locks_of(base, job_id, self.node)
        self.storage = PosixStorage(self.root, direct_io=False)
        self.coord = Coordinator(process_group, timeout)
        self.bg = Coordinator(process_group, timeout, channel="tier")      # created here, used by the thread
        busy = namespace.hold(base, job_id, self.node, self.coord.rank)     # (one live process per namespace rank)
        seen: list[tuple[str, str | None]] = self.coord.exchange((self.node, busy), None, "memory tier (nodes)")
        self.nodes: list[str] = [n for n, _ in seen]
        self.rank, self.world = self.coord.rank, self.coord.world
        why = next((b for _, b in seen if b is not None), None)
        if why is not None:                 # (on every rank: one refused is the whole tier refused)
            raise CheckpointBusyError(why)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.drained: int | None = None
        #: what the last restore did: {"step", "files_from_peers", "files_from_fallback"} (for logs and tests)
        self.last_restore: dict[str, Any] = {}
        self.last_load: Any = None          # the LoadResult of the last restore
        self._handle: Any = None
        #: when the last save's background work (commit, replicas, drains) ended (``time.perf_counter``); None before
        self.done_at: float | None = None
        self._buffers = Buffers()           # the copies' buffers, kept between saves (tier threads only)

    # ------------------------------------------------------------------ layout

    def step_storage(self, step: int) -> PosixStorage:
        return self.storage.child(step_name(step))

    def replica_targets(self, rank: int) -> list[int]:
        """The ranks holding copies of ``rank``'s data: the same local position on the next ``replicas`` other
        nodes (in order of first appearance), fewer when there are fewer other nodes."""
        order = list(dict.fromkeys(self.nodes))
        members = {n: [r for r, m in enumerate(self.nodes) if m == n] for n in order}
        mine = self.nodes[rank]
        pos = members[mine].index(rank)
        out: list[int] = []
        for i in range(1, len(order)):
            if len(out) >= self.replicas:       # (checked first: replicas=0 is no copy at all)
                break
            node = order[(order.index(mine) + i) % len(order)]
            out.append(members[node][pos % len(members[node])])
        return out

    def local_steps(self) -> list[int]:
        """Steps this node holds a commit marker for, oldest first (no collective)."""
        if not os.path.isdir(self.root):
            return []
        return sorted(s for s in (parse_step(d) for d in os.listdir(self.root))
                      if s is not None and os.path.isfile(os.path.join(self.root, step_name(s), COMMIT_MARKER)))

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, *, wait: bool = False, options: SaveOptions | None = None,
             drain_to: Storage | Sequence[Storage] | None = None) -> None:
        """Save ``state`` as ``step`` into the memory tier (collective). Returns once the snapshot is taken; the
        write to shared memory, the commit on every node and the replication run in the background (``wait=True``:
        return when done). A save of the tier still running is waited for first; its error is raised here. With
        ``options.if_busy="skip"`` the step is skipped (on every rank) while another save of this process runs.
        ``drain_to``: also copy the checkpoint to this (slower) tier, or these in order, in the background, from
        shared memory —
        every rank its own data file, then rank 0 commits there: the same checkpoint, not re-staged from the
        model; ``drained`` is then set to ``step``."""
        from liferaft.core.save import async_save

        opts = options or SaveOptions()
        if opts.if_busy == "skip" and self.world > 1:
            running = self._thread is not None and self._thread.is_alive()
            if any(self.coord.exchange(running, None, "memory tier (busy)")):
                return
        elif opts.if_busy == "skip" and self._thread is not None and self._thread.is_alive():
            return
        self.wait()
        # (one manifest listing every chunk: a node restores from the manifest and the data files it holds, and
        # a node's chunk tables would live only in its own memory and its peers')
        opts = SaveOptions(**{**opts.__dict__, "overwrite": True, "compression": "off", "incremental_base": None,
                              "chunk_tables": False, "metadata": {**dict(opts.metadata), "step": step, "job_id": self.job_id,
                                           "tier": "memory"}})
        handle = async_save(self.step_storage(step), state, process_group=self.process_group, options=opts)
        if handle is None:              # if_busy="skip": another save of this process is in flight
            return
        self._handle = handle
        self._thread = threading.Thread(target=self._finish, args=(step, handle, drain_to),
                                        name="liferaft-memory-tier", daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    @property
    def busy(self) -> bool:
        """True while a save of this tier runs in the background (on this rank)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the tier's save in flight; raise what it raised (on every rank)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _finish(self, step: int, handle: Any, drain_to: Storage | Sequence[Storage] | None) -> None:
        """Background: wait for the local commit, then commit on every node, replicate, drain, drop old steps."""
        def saved() -> None:
            handle.wait()           # raises what the async save raised (its result is not shared)

        try:
            self.bg.run(saved, "memory tier (commit)")
            record = self.bg.run_on_zero(lambda: read_commit(self.step_storage(step)), "memory tier (commit)")
            self._commit_on_node(step, record)
            self.bg.exchange(None, None, "memory tier (committed)")
            if self.parity:
                parity.save(self, step)     # XOR parity across the node's group instead of full replicas
            else:
                self._replicate(step)
            targets = [] if drain_to is None else [drain_to] if isinstance(drain_to, Storage) else list(drain_to)
            for target in targets:
                self._drain(step, target, record)
            self.done_at = time.perf_counter()
            self._drop_old(step)
        except BaseException as e:  # noqa: BLE001 - raised on the next save/wait
            self._error = e

    def _drain(self, step: int, target: Storage, record: CommitRecord) -> None:
        """Copy the step to ``target``: each rank its own data file, then rank 0 the manifest and the marker (the
        commit protocol of docs/FORMAT.md §8, with the bytes already in memory)."""
        def copy_mine() -> None:
            mine = self._own_file(step)
            if mine is not None:
                copy_file(self.step_storage(step), mine, target, self._buffers)
            target.sync()

        self.bg.run(copy_mine, "memory tier (drain)")
        self.bg.run(lambda: publish_commit(target, record) if self.rank == 0 else None, "memory tier (drain commit)")
        self.drained = step

    def _commit_on_node(self, step: int, record: CommitRecord) -> None:
        """The lowest rank of each node other than rank 0's writes the manifest, then the marker."""
        if self._leader() and self.node != self.nodes[0]:
            publish_commit(self.step_storage(step), record)

    def _own_file(self, step: int) -> str | None:
        for name in self.step_storage(step).list():
            if data_file_rank(name) == self.rank:
                return name
        return None

    def _replicate(self, step: int) -> None:
        """Send this rank's data file to its replica targets; receive those it holds copies of."""
        mine = self._own_file(step)
        size = self.step_storage(step).size(mine) if mine else 0
        files = self.bg.exchange((mine, size), None, "memory tier (replicate)")
        sends = [(t, mine, size) for t in self.replica_targets(self.rank)] if mine else []
        recvs = [(src, name, n) for src, (name, n) in enumerate(files)
                 if name and src != self.rank and self.rank in self.replica_targets(src)
                 and self.nodes[src] != self.node]
        transfer_files(self.bg, self.step_storage(step), sends, recvs, self.rank, self.bandwidth,
                       buffers=self._buffers)

    def _drop_old(self, newest: int) -> None:
        """Remove steps beyond ``keep`` from this node once ``newest`` is committed everywhere (rank-local)."""
        steps = sorted(set(self.local_steps() + [newest]))
        if not self._leader():
            return
        for s in steps[:-self.keep]:
            shutil.rmtree(os.path.join(self.root, step_name(s)), ignore_errors=True)
        parity.drop(self.root, steps[-self.keep:])

    def forget_after(self, step: int) -> None:
        """Remove every step newer than ``step`` from this node (committed or not; its commit marker first, its
        parity too): a rollback, the run going on from ``step`` (rank-local: one rank per node removes)."""
        if not self._leader() or not os.path.isdir(self.root):
            return
        newer = [s for s in (parse_step(d) for d in os.listdir(self.root)) if s is not None and s > step]
        for s in sorted(newer, reverse=True):
            folder = os.path.join(self.root, step_name(s))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, COMMIT_MARKER))
            shutil.rmtree(folder, ignore_errors=True)
        parity.drop(self.root, [s for s in self.local_steps() if s <= step])

    # ------------------------------------------------------------------ restore

    def restore(self, state: Any, *, options: LoadOptions | None = None, newer_than: int | None = None,
                fallback: Callable[[int], Storage] | None = None, strict: bool = True,
                accept: Callable[[int, Mapping[str, Any]], bool] | None = None) -> int | None:
        """Load the newest step that the live nodes hold completely into ``state`` (collective); None if there is
        none (or none newer than ``newer_than``). Returns the step loaded; ``last_restore`` and ``last_load`` (its
        LoadResult) say how.

        Each rank reads what its node holds straight from shared memory into its tensors; the byte ranges its
        load plan needs from data files only other nodes hold are read there by a rank of such a node and sent to
        it (``core.load.load_held``: no file is copied between nodes, only the ranges needed, through a bounded
        buffer). A node lacking the step's commit gets its manifest and marker (small) first. For a step also
        drained to a slower tier (``fallback(step)``: that tier's checkpoint of the step, the same save), the
        files no live node holds are copied from there into each node's memory first: tiers mix when replicas
        were lost. Any layout and world size. Every byte is verified against the manifest's checksums as it is
        copied into the state: a damaged copy raises CorruptCheckpointError on every rank (nothing falls back to
        another copy), a peer that dies during the transfer raises DistributedError within ``timeout``.
        ``accept(step, its manifest's extra)``: a node's copy it refuses is not listed (a step of a run a manager
        rolled back from, ``manager.rollback``)."""
        from liferaft.core.load import load_held

        self.wait()
        def listing() -> dict[int, Any]:
            return {s: v for s, v in ((s, self._listing(s, accept)) for s in self.local_steps()) if v is not None}

        everyone = self.coord.run(listing, "memory tier (listing)")
        step, holder = newest_complete(everyone, _rebuildable if self.parity else None)
        mixed = None
        if fallback is not None:
            mixed = self.coord.broadcast_from_zero(
                _newest_mixed(everyone, fallback, step) if self.rank == 0 else None, None, "memory tier (mix)")
        if mixed is not None:
            step, holder = mixed
        if step is None or (newer_than is not None and step <= newer_than):
            return None
        st = self.step_storage(step)
        need = everyone[holder][step][0]
        have = {n for held in everyone for n in held.get(step, ((), {}))[1]}
        rebuilt = set(need) - have if mixed is None and self.parity else set()
        if rebuilt:                     # a lost node's files, rebuilt from its group's parity into a live node
            headers = _headers(everyone, step)
            self.coord.run(lambda: parity.check_sizes(headers, rebuilt, open_checkpoint(st).files, st.url)
                           if step in everyone[self.rank] else None, "memory tier (parity sizes)")
            parity.rebuild(self, step, headers, rebuilt)
            for name in rebuilt:        # (the same on every rank: the group's lowest live member holds it now)
                h = next(h for h in headers.values() if name in (f[0] for f in h["files"]))
                builder = min(x for x in h["members"] if x in headers)
                everyone[builder][step][1][name] = next(f[1] for f in h["files"] if f[0] == name)
            have |= rebuilt
        from_fallback = 0
        if mixed is not None or not all(step in held for held in everyone):     # (the same on every rank)
            from_fallback = self._complete_commit(step, holder, set(need) - have if mixed else set(), fallback)
        holders = file_holders(everyone, step, need, have)
        self.last_load = load_held(st, state, holders=holders, process_group=self.process_group, strict=strict,
                                   options=options)
        mine = {n for r, held in enumerate(everyone) if self.nodes[r] == self.node for n in held.get(step, ((), {}))[1]}
        self.last_restore = {"step": step, "files_from_peers": len(set(need) & have - mine),
                             "files_from_fallback": from_fallback, "bytes_from_peers": self.last_load.bytes_received,
                             **({"files_rebuilt": len(rebuilt)} if self.parity else {})}
        return step

    def _complete_commit(self, step: int, holder: int, lost: set[str],
                         fallback: Callable[[int], Storage] | None) -> int:
        """Collective: the commit of ``step`` (from rank ``holder``) on every node lacking it, and the ``lost``
        files (no live node holds them) copied from ``fallback(step)`` into every node; the files copied."""
        st = self.step_storage(step)
        record = self.coord.run(lambda: read_commit(st) if self.rank == holder else None,
                                "memory tier (manifest)")[holder]

        def fetch() -> int:
            copied = 0
            if lost and self._leader():             # what no live node holds: from the slower tier
                assert fallback is not None
                for name in sorted(lost):
                    copy_file(fallback(step), name, st, self._buffers)
                    copied += 1
                st.sync()
            if self._leader() and not os.path.isfile(os.path.join(st.root, COMMIT_MARKER)):
                publish_commit(st, record)
            return copied

        return self.coord.run(fetch, "memory tier (fetch)")[self.rank]

    def _leader(self) -> bool:
        return min(r for r, m in enumerate(self.nodes) if m == self.node) == self.rank

    def _listing(self, step: int, accept: Callable[[int, Mapping[str, Any]], bool] | None = None
                 ) -> tuple[tuple[str, ...], dict[str, int], str, dict[str, Any] | None] | None:
        """(data files the step's manifest names, those this node holds at the size the manifest records with their
        sizes, manifest name, this rank's parity header of the step or None); None if unreadable or refused by
        ``accept``. Only ``step-N`` folders are steps (``local_steps``): other folders of the node (a ``steplog``)
        are never listed."""
        st = self.step_storage(step)
        try:
            m = open_checkpoint(st)
        except LiferaftError:
            return None
        recorded = m.extra.get("step")
        if type(recorded) is int and recorded != step:
            return None                 # a step folder renamed or copied into place: not this step's copy
        if accept is not None and not accept(step, m.extra):
            return None
        held = {}
        for name in st.list():
            if name.startswith(DATA_DIR + "/") and name in m.files:
                try:
                    size = st.size(name)
                except (OSError, LiferaftError):
                    continue            # not a regular file of this node's copy: not held
                if size == m.files[name]:
                    held[name] = size   # (a file of another length is damaged: not held)
        return tuple(sorted(m.files)), held, manifest_name(m.save_id), \
            parity.read_header(self.root, step, self.rank) if self.parity else None

    def release(self) -> None:
        """Free this node's shared memory of this job and the tier's copy buffers (a clean exit). Not
        collective."""
        self.wait()
        self._buffers = Buffers()           # (the copies' kept buffers go too)
        shutil.rmtree(self.root, ignore_errors=True)     # (the ranks' locks live apart: ``tiers.namespace``)


def newest_complete(everyone: list[dict[int, Any]],
                    rebuild: Callable[[list[dict[int, Any]], int, set[str], set[str]], bool] | None = None
                    ) -> tuple[int | None, int]:
    """The newest step whose every data file some rank holds at the size its manifest needs (or, with
    ``rebuild``, that says the missing ones can be rebuilt), and the lowest rank holding its commit ((None, -1) if
    there is none). Pure: the same on every rank."""
    for step in sorted({s for held in everyone for s in held}, reverse=True):
        holders = [r for r, held in enumerate(everyone) if step in held]
        need = set(everyone[holders[0]][step][0])
        have = {name for r in holders for name in everyone[r][step][1]}
        if need <= have or (rebuild is not None and rebuild(everyone, step, need - have, have)):
            return step, holders[0]
    return None, -1


def _headers(everyone: list[dict[int, Any]], step: int) -> dict[int, Any]:
    """Rank → its parity header of ``step`` (live ranks that hold one)."""
    return {r: held[step][3] for r, held in enumerate(everyone)
            if step in held and len(held[step]) > 3 and held[step][3] is not None}


def _rebuildable(everyone: list[dict[int, Any]], step: int, missing: set[str], have: set[str]) -> bool:
    return parity.rebuildable(_headers(everyone, step), have, missing)


def file_holders(everyone: list[dict[int, Any]], step: int, need: Sequence[str],
                 have: set[str]) -> dict[str, list[int]]:
    """For each data file of ``step``: the ranks whose node holds it (from ``everyone``'s listings); a file no
    live node holds (copied from a slower tier on every node) is held by every rank. Pure."""
    out: dict[str, list[int]] = {name: [] for name in need}
    for r, held in enumerate(everyone):
        for name in held.get(step, ((), {}))[1]:
            if name in out:
                out[name].append(r)
    return {name: ranks if name in have else list(range(len(everyone))) for name, ranks in out.items()}


def _newest_mixed(everyone: list[dict[int, Any]], fallback: Callable[[int], Storage],
                  complete: int | None) -> tuple[int, int] | None:
    """Rank 0: the newest step newer than ``complete`` that memory holds in part and the slower tier holds as the
    same save (its commit names the same manifest), with a rank holding its memory commit; None if none."""
    for step in sorted({s for held in everyone for s in held}, reverse=True):
        if complete is not None and step <= complete:
            return None
        holders = [r for r, held in enumerate(everyone) if step in held]
        try:
            marker = decode_commit_marker(read_marker(fallback(step)))
        except (OSError, LiferaftError):
            continue
        if marker.manifest == everyone[holders[0]][step][2]:
            return step, holders[0]
    return None


class Buffers:
    """Page-aligned buffers of ``PIECE`` bytes kept between the copies of one tier (``copy_file``,
    ``transfer_files``), so that a save's replication and drain do not first-touch fresh memory each time (about
    1 GB/s on the project's VMs). One user at a time: the tier's background thread (and the thread it starts to
    receive while it sends)."""

    def __init__(self) -> None:
        self._held: dict[str, list[torch.Tensor]] = {}

    def get(self, kind: str, count: int, size: int) -> list[torch.Tensor]:
        """``count`` buffers of at least ``size`` bytes for ``kind`` ("copy", "send", "recv"), views of ``size``."""
        from liferaft.staging.pool import page_aligned_empty

        held = self._held.get(kind, [])
        if len(held) < count or any(b.numel() < size for b in held):
            held = self._held[kind] = [page_aligned_empty(max(4096, size)) for _ in range(count)]
        return [b[:size] for b in held[:count]]


def copy_file(src: Storage, name: str, dst: Storage, buffers: Buffers | None = None) -> None:
    """Copy file ``name`` from ``src`` to ``dst`` (durable), in pieces of ``PIECE`` bytes through a page-aligned
    buffer (O_DIRECT where ``dst`` allows; ``buffers``: kept between copies)."""
    size = src.size(name)
    (buf,) = (buffers or Buffers()).get("copy", 1, max(4096, min(size, PIECE)))
    mv = memoryview(buf.numpy())
    w = dst.open_writer(name)
    try:
        for off in range(0, size, PIECE):
            n = min(PIECE, size - off)
            if src.read_into(name, off, mv[:n]) != n:
                raise LiferaftError(f"{src.url}/{name}: short read while copying it to {dst.url}")
            w.pwrite(mv[:n], off)
        w.close()
    except BaseException:
        w.abort()
        raise


def transfer_files(coord: Coordinator, storage: PosixStorage, sends: list[tuple[int, str, int]],
                   recvs: list[tuple[int, str, int]], rank: int, bandwidth: float | None = None,
                   piece: int = PIECE, buffers: Buffers | None = None) -> None:
    """Copy whole files between ranks: ``sends`` (to rank, name, size) are read from ``storage`` and sent in
    pieces; ``recvs`` (from rank, name, size) are written to ``storage`` under the same name (durable). Every
    rank must call it with its part of one plan: each rank sends its files in the order of their names and
    receives its files in the order of their names, the sends on this thread while a second thread receives
    (both directions of a link at once). ``bandwidth`` (bytes/s) paces the sends. Files go in pieces of
    ``piece`` bytes, two in flight each way (the next piece is read while one travels, and received while one
    is written), through ``buffers`` (kept between calls by the tier). A failure of either direction raises
    here once both have ended."""
    if coord.world == 1 or (not sends and not recvs):
        return
    for peer, name, size in sends + recvs:      # (sizes a peer announced: checked before anything is allocated)
        if type(size) is not int or not 0 <= size <= MAX_INT or not isinstance(name, str):
            raise DistributedError(f"memory tier: the transfer of {name!r} with rank {peer} was announced with "
                                   f"{size!r} bytes (not a file size): not a liferaft peer of this version, or "
                                   "its memory is damaged; nothing was copied")
    sizes = [size for *_, size in sends + recvs]
    piece = max(1, min(piece, max(sizes + [1])))
    held = buffers or Buffers()
    send_bufs = held.get("send", 2, piece) if sends else []
    recv_bufs = held.get("recv", 2, piece) if recvs else []
    errors: list[BaseException] = []

    def receive_all() -> None:
        failed: BaseException | None = None     # a local failure: what is still to come is received and dropped
        try:
            for peer, name, size in sorted(recvs, key=lambda r: r[1]):
                failed = _recv_file(coord, storage, name, _spans(size, piece), recv_bufs, peer,
                                    keep=failed is None) or failed
            if failed is None:
                storage.sync()
        except BaseException as e:  # noqa: BLE001 - raised by the caller's thread below
            errors.append(e)
        if failed is not None:
            errors.append(failed)

    receiver = threading.Thread(target=receive_all, name="liferaft-tier-recv", daemon=True) if recvs else None
    if receiver is not None:
        receiver.start()
    try:
        for peer, name, size in sorted(sends, key=lambda r: r[1]):
            _send_file(coord, storage, name, _spans(size, piece), send_bufs, peer, bandwidth)
    except BaseException as e:  # noqa: BLE001 - raised below, after the receiver has ended
        errors.append(e)
    finally:
        if receiver is not None:
            receiver.join()
    local = [e for e in errors if not isinstance(e, DistributedError)]
    if errors:
        raise (local or errors)[0]          # (a peer that gave up waiting on this rank is the effect, not the cause)


def _spans(size: int, piece: int) -> list[tuple[int, int]]:
    return [(off, min(piece, size - off)) for off in range(0, size, piece)]


def _recv_file(coord: Coordinator, storage: PosixStorage, name: str, spans: list[tuple[int, int]],
               bufs: list[torch.Tensor], peer: int, keep: bool = True) -> BaseException | None:
    """Receive ``spans`` of file ``name`` from ``peer`` (tags alternate 0/1 as the sender sends them) and write
    them to a new file of ``storage``; return None, or the local failure to write it (``keep`` False: drop them
    unwritten). A local failure (no room left, say) removes the partial file and drops the rest of the pieces as
    they come, so that the sender finishes and this rank reports its own cause at once instead of every rank
    waiting out the timeout; a failure to receive (DistributedError) raises."""
    failed: BaseException | None = None
    w: FileWriter | None = None
    if keep:
        try:
            w = storage.open_writer(name)
        except (OSError, LiferaftError) as e:
            failed = e
    try:
        pending = [coord.irecv(bufs[k][:n], peer, k) for k, (_, n) in enumerate(spans[:2])]
        for k, (off, n) in enumerate(spans):
            pending[k % 2].wait()
            if w is not None:
                try:
                    w.pwrite(memoryview(bufs[k % 2].numpy())[:n], off)
                except (OSError, LiferaftError) as e:
                    failed, w = e, _aborted(w)
            if k + 2 < len(spans):                  # the buffer is free again: post the piece after next
                pending[k % 2] = coord.irecv(bufs[k % 2][:spans[k + 2][1]], peer, k % 2)
        if w is not None:
            try:
                w.close()
            except (OSError, LiferaftError) as e:
                failed, w = e, _aborted(w)
    except BaseException:
        if w is not None:
            w.abort()
        raise
    return failed


def _aborted(w: FileWriter) -> None:
    with contextlib.suppress(OSError, LiferaftError):
        w.abort()


def _send_file(coord: Coordinator, storage: PosixStorage, name: str, spans: list[tuple[int, int]], bufs: list[torch.Tensor], peer: int,
               bandwidth: float | None) -> None:
    """Read and send ``spans`` of the file ``name`` of ``storage`` (opened through it: no link followed, a regular
    file only): piece k+1 is read while piece k is on its way (tags alternate 0/1,
    as the receiver posts them), paced to ``bandwidth`` bytes/s."""
    pending: list[Any] = [None, None]
    with os.fdopen(storage.open_read(name), "rb") as f:
        t_start, sent = time.monotonic(), 0
        try:
            for k, (_, n) in enumerate(spans):
                if pending[k % 2] is not None:
                    pending[k % 2].wait()
                got = f.readinto(memoryview(bufs[k % 2].numpy())[:n])
                if got != n:
                    raise CorruptCheckpointError(f"{storage.url}/{name}: the file is shorter than the "
                                                 f"{sum(m for _, m in spans)} bytes announced for it (it changed "
                                                 "while being sent); the rest of it is not sent")
                pending[k % 2] = coord.isend(bufs[k % 2][:n], peer, k % 2)
                sent += n
                if bandwidth:
                    ahead = sent / bandwidth - (time.monotonic() - t_start)
                    if ahead > 0:
                        time.sleep(ahead)
        finally:
            for p in pending:
                if p is not None:
                    p.wait()


__all__ = ["DEFAULT_BASE", "MemoryTier", "default_node", "file_holders", "newest_complete", "transfer_files"]
