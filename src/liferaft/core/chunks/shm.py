"""Same-host read sharing through shared memory: the segments of one load.

When ranks on one host need the same verified bytes (a resharding load makes every rank read every row of a
Shard(0) checkpoint; replicated tensors are read by every data-parallel rank), one of them reads, decodes and
verifies each such span once and puts the verified bytes into a slot of its own segment; the others copy their
boxes straight from that slot (``core.chunks.reader``). The slots are a ring: a slot is reused only after every
rank that reads from it has said it is done, so a rank's shared memory is bounded by ``slots * slot_bytes``
whatever the checkpoint's size; a span larger than a slot is not shared (each rank reads it for itself). A
load reserves the first slot's pages when it makes the segment and the others while that slot is read; a slot
that finds no room is left out of the ring (a ring of one slot still works, one read at a time).

Lifetime, so that no segment outlives its load or is trusted by another:

- names are unique per load: ``liferaft-load-<pid>-<random>-r<rank>`` in ``/dev/shm``, created exclusively
  (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600); a receiver opens a name only when the planning exchange of the
  same load handed it over, and checks it is a regular file of the expected size owned by this user;
- every rank unlinks its own name as soon as the ranks of the host have opened it (after the set-up exchange),
  so from then on the segment lives only in the mappings of the running ranks and dies with them, kill -9
  included; a load that fails before that unlinks its own name and every peer name it was given, and the next
  load on the host removes names whose process is gone (``sweep_stale``);
- a slot's bytes are only read after its writer said they passed their checksums (the notice carries the slot
  and the outcome), and only until the receiver acknowledged it: a segment is never read as data by itself.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass, field

import torch

from liferaft.errors import DistributedError, StorageError
from liferaft.staging.pool import PAGE

SHM_DIR = "/dev/shm"
#: Slots per rank: one being filled while the peers copy from the other (double buffering). Measured on a
#: 0.5 GiB Shard(0) -> Shard(1) load on 2 ranks: the read phase no slower than with 3 or 4, and each slot less is
#: 32 MiB less to reserve (zeroed tmpfs pages, ~30 ms each on these VMs) before the first read.
SLOTS = 2
#: The most a load on several ranks reads at a time from local storage, whatever its ``read_size`` (``core.open``):
#: a rank that reads spans for its host's other ranks fills slots of up to this size, ``SLOTS`` of them, in
#: ``SHM_DIR``; at 16 MiB reads a 64 MiB /dev/shm (Docker's default) had room for 3 reading ranks, and sharing
#: was off for a host of 4 (review helper-124). A resharding load on 2 ranks was 1.03x its same-layout load at
#: 8 MiB reads (2026-12-07). A larger ``read_size`` (``max_read_bytes`` None) is taken down to this.
SHARED_READ_SIZE = 8 << 20
_NAME = re.compile(r"^liferaft-load-(\d+)-[0-9a-f]{16}-r\d+$")


class SegmentError(StorageError):
    """A segment could not be made in the shared-memory folder (the load's ranks then read for themselves)."""


class SegmentSpaceError(SegmentError):
    """The shared-memory folder has no room for a segment (its size is reserved before anything is mapped: a
    mapping of pages tmpfs cannot provide kills the process with SIGBUS on first touch)."""


def slot_size(max_read: int) -> int:
    """The size of a slot for spans of at most ``max_read`` bytes (``LoadOptions.max_read_bytes``): their whole
    pages, since the reader of a plain span reads it into the slot page aligned (straight, or through a private
    buffer from a device, ``host_reads``); a multiple of the page, so that every slot of a ring starts on one."""
    return -(-max_read // PAGE) * PAGE + 2 * PAGE


def available() -> bool:
    """Whether this host has a shared-memory folder to put segments in."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def host_key() -> str:
    """Who shares this process's shared-memory folder: the host name, the boot, and the folder's device and inode
    (two containers with the host's name but a ``/dev/shm`` each, e.g. ``docker run --network=host``, differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(SHM_DIR)
        folder = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        folder = ""
    return f"{socket.gethostname()}|{boot}|{folder}"


def new_name(rank: int) -> str:
    """A segment name no earlier or later load can have (pid + 64 random bits)."""
    return f"liferaft-load-{os.getpid()}-{secrets.token_hex(8)}-r{rank}"


def sweep_stale(min_age: float = 3600.0) -> int:
    """Remove the segments of loads whose process is gone (a rank killed before it unlinked its name) and that
    were made more than ``min_age`` seconds ago; return how many. Names of running processes are left alone; so
    are young ones, whose process may live in another PID namespace sharing this folder (a name lives only while
    its load sets up, bounded by the load's timeout)."""
    removed = 0
    now = time.time()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        found = _NAME.match(name)
        if not found or int(found.group(1)) == os.getpid():
            continue
        try:
            if now - os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False).st_mtime < min_age:
                continue
            os.kill(int(found.group(1)), 0)
            continue                                    # alive (or not ours to signal): leave it
        except (ProcessLookupError, OverflowError):
            pass                                        # (no such process; a pid no system has: ≥ 2**31)
        except OSError:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    return removed


def unlink(name: str) -> None:
    """Remove ``name`` if it is still there (never raises)."""
    if _NAME.match(name):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


@dataclass
class Segment:
    """One rank's ring of ``slots`` slots of ``slot_bytes`` in a mapped shared-memory file."""

    name: str
    slot_bytes: int
    slots: int
    writable: bool
    reserved: int = 0               # slots backed by reserved pages (writable segments): the first ones
    _map: mmap.mmap | None = field(default=None, repr=False)
    _fd: int = field(default=-1, repr=False)
    _tensor: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def create(cls, name: str, slot_bytes: int, slots: int = SLOTS, reserve: int | None = None) -> Segment:
        """A new segment with its first ``reserve`` slots (default: all) reserved in ``SHM_DIR`` before it is
        mapped (``posix_fallocate``): a sparse file on a tmpfs too small for it (Docker's default
        ``--shm-size`` is 64 MiB) would map fine and kill the process with SIGBUS at the first write past the
        free space; a slot past ``reserved`` must not be written before ``reserve_rest`` has reserved it.
        SegmentSpaceError, with nothing left behind, when the folder's free space is short for the slots to
        reserve now or the reservation is refused (ENOSPC): the others are reserved later as far as room remains
        (``reserve_rest``), so 7 ranks of a host each reserve their first 8 MiB slot in Docker's 64 MiB default."""
        size = slot_bytes * slots
        reserve = slots if reserve is None else max(1, min(reserve, slots))
        try:
            st = os.statvfs(SHM_DIR)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = size                                 # (unknown: the reservation below decides)
        if free < slot_bytes * reserve:
            raise SegmentSpaceError(f"{SHM_DIR}: {free} bytes free, {reserve} slot(s) of a shared-memory segment "
                                    f"of {slot_bytes} bytes each (LoadOptions.max_read_bytes, in whole pages) do "
                                    f"not fit; give it more room (docker --shm-size) or lower max_read_bytes")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise SegmentError(f"{SHM_DIR}: cannot make a shared-memory segment ({e})") from None
        try:
            try:
                os.ftruncate(fd, size)                  # (the whole size: the peers map all of it)
                os.posix_fallocate(fd, 0, slot_bytes * reserve)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise SegmentError(f"{SHM_DIR}: cannot reserve a shared-memory segment of {size} bytes "
                                       f"({e})") from None
                raise SegmentSpaceError(f"{SHM_DIR}: no room to reserve a shared-memory segment of {size} bytes "
                                        f"({e.strerror}); give it more room (docker --shm-size) or lower "
                                        f"max_read_bytes") from None
            seg = cls(name, slot_bytes, slots, True, reserved=reserve)
            try:
                seg._map = mmap.mmap(fd, size)
            except OSError as e:
                raise SegmentError(f"{SHM_DIR}: cannot map a shared-memory segment of {size} bytes ({e})") from None
        except BaseException:
            os.close(fd)
            unlink(name)
            raise
        if reserve < slots:
            seg._fd = fd                                # (for ``reserve_rest``; closed by ``close``)
        else:
            os.close(fd)
        return seg

    def reserve_rest(self) -> None:
        """Reserve the slots past ``reserved``, one by one, stopping at the first refused (no room: the ring
        then has the slots reserved so far, at least one). Run while the first slot is read, in one thread;
        ``reserved`` is read once it has returned."""
        while self.reserved < self.slots and self._fd >= 0:
            try:
                os.posix_fallocate(self._fd, self.reserved * self.slot_bytes, self.slot_bytes)
            except OSError:
                return
            self.reserved += 1

    @classmethod
    def attach(cls, name: str, slot_bytes: int, slots: int, owner: int) -> Segment:
        """Rank ``owner``'s segment, read-only; refused unless it is a regular file of this user with exactly the
        size the load planned (all four come from the peer's set-up message: checked before use)."""
        if not isinstance(name, str) or type(slot_bytes) is not int or type(slots) is not int:
            raise DistributedError(f"rank {owner} described its shared-memory segment as {name!r} with "
                                   f"{slot_bytes!r} x {slots!r} bytes, not a name and two counts; load with "
                                   f"LoadOptions(share_reads=False) and report this")
        if not _NAME.match(name):
            raise DistributedError(f"rank {owner} named the shared-memory segment {name!r}, which is not one of "
                                   f"liferaft's; load with LoadOptions(share_reads=False) and report this")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)   # (a FIFO: no wait)
        except OSError as e:
            raise DistributedError(f"the shared-memory segment {path} of rank {owner} cannot be opened ({e}); is "
                                   f"rank {owner} on this host and alive? Load with "
                                   f"LoadOptions(share_reads=False) to read without sharing") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != slot_bytes * slots \
                    or slot_bytes <= 0 or slot_bytes % PAGE or slots < 1:
                raise DistributedError(f"the shared-memory segment {path} of rank {owner} is not a regular file "
                                       f"of this user with {slot_bytes * slots} bytes; refused (load with "
                                       f"LoadOptions(share_reads=False))")
            seg = cls(name, slot_bytes, slots, False)
            seg._map = mmap.mmap(fd, slot_bytes * slots, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return seg

    def slot(self, i: int, nbytes: int, offset: int = 0) -> torch.Tensor:
        """``nbytes`` of slot ``i`` from its byte ``offset`` as a uint8 tensor over the mapping (DistributedError
        if they are not inside the slot: the slot and span come from a peer's notice)."""
        if self._tensor is None:
            assert self._map is not None
            if self.writable:
                self._tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            else:                       # torch wants a writable buffer; the mapping's protection stays read-only
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    self._tensor = torch.frombuffer(memoryview(self._map), dtype=torch.uint8)
        if not 0 <= i < self.slots or not 0 <= nbytes or not 0 <= offset or offset + nbytes > self.slot_bytes:
            raise DistributedError(f"shared-memory segment {self.name}: {nbytes} bytes from byte {offset} of slot "
                                   f"{i} are outside it ({self.slots} slots of {self.slot_bytes})")
        return self._tensor[i * self.slot_bytes + offset:i * self.slot_bytes + offset + nbytes]

    def close(self) -> None:
        """Drop the mapping (the memory goes when every rank has dropped its own), and the name if still there."""
        if self.writable:
            unlink(self.name)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tensor = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:         # a view still exported: the mapping goes with the last view
                pass
            self._map = None


@dataclass
class HostShare:
    """What ``execute_reads`` needs for same-host sharing: this rank's own segment and the segments of the
    ranks it receives from (by rank)."""

    own: Segment | None             # None: this rank reads no shared span
    peers: dict[int, Segment]

    def close(self, background: bool = False) -> None:
        """Close every segment. ``background``: their names now, the mappings in a daemon thread (unmapping the
        last mapping of a segment frees its pages: ~10 ms per 32 MiB here, after the load's reads are done and
        nothing uses the mappings any more); a fork waits for it first (``finish_unmaps``)."""
        segs = list(self.peers.values()) + ([self.own] if self.own is not None else [])
        for seg in segs:
            if seg.writable:
                unlink(seg.name)
        if not background:
            for seg in segs:
                seg.close()
            return

        def unmap() -> None:
            try:
                for seg in segs:
                    seg.close()
            finally:
                with _UNMAP_LOCK:
                    _UNMAPPING.remove(threading.current_thread())
        global _AT_FORK
        with _UNMAP_LOCK:
            if not _AT_FORK and hasattr(os, "register_at_fork"):
                os.register_at_fork(before=finish_unmaps)
                _AT_FORK = True
            t = threading.Thread(target=unmap, name="liferaft-unmap", daemon=True)
            _UNMAPPING.append(t)
            t.start()


_UNMAPPING: list[threading.Thread] = []     # background unmaps not done yet (``HostShare.close``)
_UNMAP_LOCK = threading.Lock()
_AT_FORK = False                            # ``finish_unmaps`` registered to run before every fork


def finish_unmaps() -> None:
    """Wait for the background unmaps still running. Runs before every fork of the process once one has
    started: a child forked right after a load (a DataLoader's workers) must inherit none of its mappings or
    descriptors, which would pin the segment's pages for the child's life."""
    with _UNMAP_LOCK:
        pending = list(_UNMAPPING)
    for t in pending:
        t.join()
