"""Local files (POSIX): positioned writes, fsync of files and folders, atomic rename for small files.

Writes and reads whose offset, length and buffer are all 4 KiB aligned may use O_DIRECT where the file system
allows it (not tmpfs): the bytes go between the device and the caller's buffer without the page cache (on these
VMs every page-cache page is a first touch of fresh memory, ~1 GB/s). Whether they do, and how many requests a
large write or read keeps in flight (split on page boundaries across threads), is the device's ``iopath.Choice``:
probed on the first large request unless the caller forces it (``PosixStorage(direct_io=..., inflight=...)``).
Unless forced, a read request whose pages are mostly in the page cache already (``iopath.cache_read_wins``: a
file just written through the cache, or read before) reads through it instead of by O_DIRECT.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import ClassVar

from liferaft.errors import CorruptCheckpointError, OptionsError, StorageError, UnsafePathError
from liferaft.storage import files, iopath, memfs
from liferaft.storage.base import RAM_READ_SIZE, FileWriter, Storage

#: ``PosixStorage.read_size`` on a device. A load reads into two scratch buffers while its caller's thread
#: verifies and copies the one before. Measured on this project's VM (0.54 GB, cold, O_DIRECT): with buffers of
#: 4 KiB pages loads reading 8 MiB at a time took 0.85 of the time of 32 MiB reads (0.343 against 0.402 s,
#: ``benchmarks/bench_readsize.py``). With the buffers of transparent huge pages (``storage.iobuf``), a load in a
#: fresh process (as a restart's is) took 0.317 and 0.331 s at 8 MiB against 0.360 and 0.386 at 16 (medians of
#: 5, interleaved, two runs; 0.405 and 0.388 at 8 MiB of 4 KiB pages): larger buffers cost their first touch,
#: which on these VMs runs at ~1 GB/s. Repeated loads in one process favoured 16 MiB (0.315 against 0.339 s).
DISK_READ_SIZE = 8 << 20

_PAGE = 4096


def fsync_dir(path: str) -> None:
    """fsync the folder ``path``, so that the entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FolderLock:
    """A held ``flock`` on a folder's descriptor: ``release`` (idempotent) unlocks and closes it, and removes the
    folder if it was made for the save and nothing was written; dropped unreleased, the descriptor is closed. A
    forked child (a DataLoader worker started during an async save) closes its copies of the held descriptors at
    once: an ``flock`` lasts while any copy is open, and the child's would hold the folder for its whole life."""

    _held: ClassVar[weakref.WeakSet[_FolderLock]] = weakref.WeakSet()
    _hooked: ClassVar[bool] = False

    def __init__(self, fd: int, made: str | None) -> None:
        self._fd: int | None = fd
        self._made = made

    @classmethod
    def track(cls, lock: _FolderLock) -> None:
        cls._held.add(lock)
        if not cls._hooked and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=cls._in_child)
            cls._hooked = True

    @classmethod
    def _in_child(cls) -> None:
        for lock in list(cls._held):
            fd, lock._fd, lock._made = lock._fd, None, None
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)                    # (closing the last descriptor drops the flock)
        if self._made is not None:
            try:
                os.rmdir(self._made)
            except OSError:
                pass

    def __del__(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class _PosixWriter(FileWriter):
    """Positioned writes; when a buffer lies on the same page boundaries as its file range, its whole pages go
    through O_DIRECT (a second descriptor) and the partial first and last pages through the page cache, which
    takes everything else. ``close`` fsyncs the file either way. The file is created exclusively and never through
    a link (``files.create_exclusive``: whatever lies at ``path`` — an older file, a planted link — is removed
    first); ``truncate=False`` writes into an existing regular file (liferaft's tools fill records of archives
    laid out by others), opened without following a link. ``fd``/``dir_fd``: a file the caller created so."""

    def __init__(self, path: str, direct: bool = False, truncate: bool = True, *,
                 fd: int | None = None, dir_fd: int | None = None,
                 choice: Callable[[int], tuple[bool, int]] | None = None) -> None:
        self.path = path
        self._name = os.path.basename(path)
        if fd is None:
            if truncate:
                fd, dir_fd = files.create_exclusive(os.path.dirname(path) or ".", self._name, mkdirs=False)
            else:
                dir_fd = files.open_root(os.path.dirname(path) or ".")
                try:
                    fd = os.open(self._name, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK |
                                 getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
                    files.check_fd(fd, path)
                    os.set_blocking(fd, True)
                except BaseException:
                    if fd is not None:
                        os.close(fd)
                    os.close(dir_fd)
                    raise
        self.fd: int | None = fd
        self._dir: int | None = dir_fd
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._dfd: int | None = None
        self._choice = choice            # request size -> (O_DIRECT, requests in flight); None: (direct, 1)
        self._lock = threading.Lock()    # opening the O_DIRECT descriptor once, from any part's thread

    def _direct_fd(self) -> int | None:
        with self._lock:
            if self._dfd is None and self.direct:
                self._open_direct()
            return self._dfd

    def _open_direct(self) -> None:
        if self._dfd is None:
            try:
                self._dfd = os.open(self._name, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_NOFOLLOW", 0) |
                                    getattr(os, "O_CLOEXEC", 0), dir_fd=self._dir)
                if os.fstat(self._dfd).st_ino != os.fstat(self.fd).st_ino:     # replaced since: not ours
                    os.close(self._dfd)
                    self._dfd = None
                    self.direct = False
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False

    def _write_direct(self, mv: memoryview, offset: int) -> int:
        """Bytes written with O_DIRECT (0 if refused: then this writer stops trying)."""
        dfd = self._direct_fd()
        if dfd is None:
            return 0
        done = 0
        try:
            while done < len(mv):
                n = os.pwrite(dfd, mv[done:], offset + done)
                done += n
                if n % _PAGE:
                    break
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct = False
        return done - done % _PAGE

    def pwrite(self, data: memoryview | bytes, offset: int) -> None:
        assert self.fd is not None, "writer is closed"
        mv = memoryview(data).cast("B")
        direct, inflight = self._choice(len(mv)) if self._choice is not None else (self.direct, 1)
        if inflight > 1 and len(mv) >= 2 * iopath.SPLIT_MIN:
            iopath.in_parallel(lambda at, n: self._pwrite(mv[at - offset:at - offset + n], at, direct) or n,
                               iopath.spans(offset, len(mv), inflight))
        else:
            self._pwrite(mv, offset, direct)

    def _pwrite(self, mv: memoryview, offset: int, direct: bool) -> None:
        head = (-offset) % _PAGE
        if direct and self.direct and len(mv) >= head + _PAGE and not mv.readonly \
                and (ctypes.addressof(ctypes.c_char.from_buffer(mv)) - offset) % _PAGE == 0:
            while head:                                         # the partial first page, through the cache
                n = os.pwrite(self.fd, mv[:head], offset)
                mv, offset, head = mv[n:], offset + n, head - n
            done = self._write_direct(mv[:len(mv) // _PAGE * _PAGE], offset)
            mv, offset = mv[done:], offset + done
        while len(mv):
            n = os.pwrite(self.fd, mv, offset)
            mv = mv[n:]
            offset += n

    def _close_dir(self) -> None:
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None

    def close(self) -> None:
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
                self._close_dir()

    def abort(self, unlink: bool = True) -> None:
        """Close without fsync; remove the file unless ``unlink`` is False (the caller removes or keeps it)."""
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if unlink and self._dir is not None:
            try:
                os.unlink(self._name, dir_fd=self._dir)
            except FileNotFoundError:
                pass
        self._close_dir()


class PosixStorage(Storage):
    """A checkpoint directory on a local (or mounted) file system. Its root is resolved once (links above it are
    the caller's); below it every file is opened through ``storage.files``: no link is followed (a data file,
    ``data/``, ``COMMIT`` or the manifest that is a link is refused with UnsafePathError), only regular files
    are read (a FIFO, device, folder: CorruptCheckpointError, never a hang), and writes create their files
    exclusively. A ``child`` or ``sibling`` is a folder below (or next to) this root that is not followed
    either when it is a link.

    ``direct_io`` and ``inflight`` choose the I/O path: None (both, the default) asks the device's
    ``iopath.Choice`` on the first request of ``iopath.PROBE_FROM`` bytes or more (probed once per device and
    process; smaller requests use O_DIRECT, one in flight); ``direct_io=True``/``False`` forces O_DIRECT (where
    the file system allows it, else buffered) or the page cache, ``inflight=k`` forces k requests in flight
    (a large request is split across k threads); forcing either never probes."""

    def __init__(self, root: str, direct_io: bool | None = None, inflight: int | None = None) -> None:
        self.root = os.path.abspath(root)
        self._base = os.path.realpath(self.root)
        self._sub: tuple[str, ...] = ()
        self._dirty_dirs: set[str] = set()
        if inflight is not None and (isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 1):
            raise OptionsError(f"PosixStorage({root!r}): inflight must be a whole number ≥ 1 (requests in flight "
                               f"per large read or write) or None (the device's probed choice), not {inflight!r}")
        if direct_io is not None and not isinstance(direct_io, bool):
            raise OptionsError(f"PosixStorage({root!r}): direct_io must be True (O_DIRECT), False (page cache) or "
                               f"None (the device's probed choice), not {direct_io!r}")
        self._auto = direct_io is None and inflight is None
        self._inflight = inflight or 1
        self.direct_io = (True if direct_io is None else bool(direct_io)) and hasattr(os, "O_DIRECT")
        self.cached_reads = 0       # read parts that would have used O_DIRECT but read through the page cache

    def io_path(self, nbytes: int, write: bool, name: str | None = None) -> tuple[bool, int]:
        """(O_DIRECT, requests in flight) for one request of ``nbytes``: forced, or the device's choice (probed
        on the first large request; a root that cannot be probed keeps O_DIRECT, one in flight). A read names
        its file ``name``: until this process has written to the device, only read paths are probed, on that
        file (nothing is written where a checkpoint is only read)."""
        c = self._choice(nbytes, write, name)
        if c is None:
            return self.direct_io, self._inflight
        if write:
            return c.write_direct and self.direct_io, c.write_inflight
        return c.read_direct and self.direct_io, c.read_inflight

    def _choice(self, nbytes: int, write: bool, name: str | None) -> iopath.Choice | None:
        """The device's ``iopath.Choice`` for a request of ``nbytes`` (None: forced, below ``PROBE_FROM``, or a
        root that cannot be probed)."""
        if not self._auto or nbytes < iopath.PROBE_FROM:
            return None
        try:
            return iopath.choice_for(self._top if os.path.isdir(self._top) else self._base,
                                     None if write or name is None else lambda: self._read_probe(name))
        except OSError:
            return None

    def _read_probe(self, name: str) -> tuple[Callable[[bool], int], int]:
        """(open ``name`` with or without O_DIRECT, its size): what ``iopath.probe_reads`` times."""
        fd = self.open_read(name)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return (lambda direct: self.open_read(name, direct=direct)), size

    @property
    def read_size(self) -> int:  # type: ignore[override]
        """The largest read a load asks of this folder by default: ``DISK_READ_SIZE`` on a device,
        ``RAM_READ_SIZE`` on a file system held in RAM."""
        return RAM_READ_SIZE if self.memory_speed else DISK_READ_SIZE

    @property
    def url(self) -> str:
        return self.root

    @property
    def memory_speed(self) -> bool:  # type: ignore[override]
        """Whether this folder is on a file system held in RAM (``storage.memfs``: tmpfs, ramfs)."""
        return memfs.in_memory(self._p(""))

    def _p(self, name: str) -> str:
        return os.path.join(self._base, *self._sub, *name.split("/"))

    @property
    def _top(self) -> str:
        return os.path.join(self._base, *self._sub)

    def _rel(self, name: str) -> str:
        files.parts_of(name, self.root)
        return "/".join((*self._sub, name))

    def _shown(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _mkdirs(self, path: str) -> None:
        parent = os.path.dirname(path)
        missing = []
        while not os.path.lexists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        self._dirty_dirs.add(os.path.dirname(path))
        for m in missing:
            self._dirty_dirs.add(os.path.dirname(m))
        os.makedirs(self._base, exist_ok=True)              # the root itself: the caller's path
        rel = os.path.relpath(os.path.dirname(path), self._base)
        if rel != ".":
            os.close(files.open_folder(self._base, rel.split(os.sep), create=True))

    def _derived(self, root: str, base: str, sub: tuple[str, ...]) -> PosixStorage:
        s = type(self)(root, direct_io=self.direct_io)     # fault-injecting subclasses stay so
        s._base, s._sub, s._auto, s._inflight = base, sub, self._auto, self._inflight
        return s

    def child(self, name: str) -> PosixStorage:
        return self._derived(os.path.join(self.root, *name.split("/")), self._base,
                             (*self._sub, *files.parts_of(name, self.root)))

    @property
    def place(self) -> str:
        """The folder's real path (links resolved; for one not made yet, its parent's real path and its name)."""
        return os.path.realpath(self.root)

    def sibling(self, name: str) -> PosixStorage:
        if not files.plain_component(name):
            raise UnsafePathError(f"{self.root}: sibling {name!r} is not the name of a folder next to it")
        root = os.path.join(os.path.dirname(self.root), name)
        if self._sub:
            return self._derived(root, self._base, (*self._sub[:-1], name))
        return self._derived(root, os.path.dirname(self._base), (name,))

    def lock_writer(self) -> Callable[[], None] | None:
        """An exclusive ``flock`` on the folder itself (made if missing; removed again at release if it was made
        here and is still empty): a second save to the same folder, from any process or thread, is refused while
        this one runs. The kernel drops it when the process dies."""
        import fcntl

        from liferaft.errors import CheckpointBusyError

        made = not os.path.lexists(self._top)
        try:
            os.makedirs(self._base, exist_ok=True)
            fd = files.open_folder(self._base, list(self._sub), self.root, create=True, error=StorageError)
        except OSError as e:            # (a file there, a read-only parent, /proc: as a first write would fail)
            raise StorageError(f"{self.root}: cannot be used as a checkpoint folder ({e.strerror or e}); choose "
                               "a folder that can be created and written") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointBusyError(f"{self.root}: another save to this folder is in progress (another process, "
                                      "or another thread of this one); two saves to one path must not run at once: "
                                      "wait for it, or save to another path") from None
        except OSError:                 # (a file system without flock: no lock, as on an object store)
            os.close(fd)
            return None
        held = _FolderLock(fd, self._top if made else None)
        _FolderLock.track(held)
        return held.release

    def open_writer(self, name: str) -> FileWriter:
        path = self._p(name)
        self._mkdirs(path)
        fd, at = files.create_exclusive(self._base, self._rel(name))
        return _PosixWriter(path, direct=self.direct_io, fd=fd, dir_fd=at,
                            choice=lambda n: self.io_path(n, write=True))

    def open_read(self, name: str, limit: int | None = None, direct: bool = False) -> int:
        """A descriptor of the regular file ``name`` open for reading (``files.open_read``: no link followed,
        at most ``limit`` bytes); the caller closes it."""
        return files.open_read(self._base, self._rel(name), limit=limit, direct=direct, shown=self._shown(name))

    _open = open_read

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        """Read into ``out`` from ``offset`` of ``name``; return the bytes read (fewer at the end of the file).
        By the device's path, except (unless forced) the parts mostly in the page cache: through it. A device
        that fails the read (EIO, ...) is a FileAccessError naming the file and the bytes (``files.access_error``);
        a missing file stays FileNotFoundError."""
        mv = memoryview(out).cast("B")
        try:
            return self._read_any(name, offset, mv)
        except OSError as e:
            raise files.access_error(self._shown(name), e, f"read bytes {offset}..{offset + len(mv)} of") from None

    def _read_any(self, name: str, offset: int, mv: memoryview) -> int:
        direct, inflight = self.io_path(len(mv), write=False, name=name)
        c = self._choice(len(mv), False, name) if self._auto else None
        floor = None if not self._auto else c.cache_floor if c is not None else iopath.MIN_RESIDENT
        if inflight > 1 and len(mv) >= 2 * iopath.SPLIT_MIN:
            got = iopath.in_parallel(lambda at, n: self._read_into(name, at, mv[at - offset:at - offset + n], direct,
                                                                   floor),
                                     iopath.spans(offset, len(mv), inflight))
            total = 0
            for (_, n), g in zip(iopath.spans(offset, len(mv), inflight), got):
                total += g
                if g < n:
                    break           # end of file within this part: what follows it is not the file's
            return total
        return self._read_into(name, offset, mv, direct, floor)

    def _read_into(self, name: str, offset: int, mv: memoryview, direct: bool, floor: float | None = None) -> int:
        """One part of a read: by O_DIRECT where asked and aligned, unless ``floor`` (not forced) and the range is
        that much in the page cache (``iopath.cache_read_wins``); else through the cache."""
        fd = None
        try:
            if direct and self.direct_io and offset % _PAGE == 0 and len(mv) % _PAGE == 0 and len(mv) \
                    and not mv.readonly and ctypes.addressof(ctypes.c_char.from_buffer(mv)) % _PAGE == 0:
                if floor is not None:
                    fd = self._open(name)
                    if iopath.cache_read_wins(iopath.resident_share(fd, offset, len(mv)), floor):
                        self.cached_reads += 1
                        direct = False
                n = self._read_direct(name, offset, mv) if direct else None
                if n is not None:
                    return n
            fd = self._open(name) if fd is None else fd
            return files.pread_full(fd, mv, offset)
        finally:
            if fd is not None:
                os.close(fd)

    def _read_direct(self, name: str, offset: int, mv: memoryview) -> int | None:
        """Read with O_DIRECT; None if the file system refuses it (then direct I/O is off for this storage)."""
        try:
            fd = self._open(name, direct=True)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct_io = False
            return None
        try:
            total = 0
            while total < len(mv):
                try:
                    n = os.preadv(fd, [mv[total:]], offset + total)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct_io = False
                    return None
                total += n
                if n == 0 or n % _PAGE:
                    break          # end of file
            return total
        finally:
            os.close(fd)

    def read_all(self, name: str, limit: int | None = None) -> bytes:
        fd = self._open(name, limit)
        try:
            return files.read_fd(fd, self._shown(name), limit)
        finally:
            os.close(fd)

    def size(self, name: str) -> int:
        fd = self._open(name)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, name: str) -> bool:
        """Whether ``name`` is a regular file; a link, FIFO, device or folder there is refused (not "absent")."""
        parts = self._rel(name).split("/")
        try:
            at = files.open_folder(self._base, parts[:-1], self._shown(name))
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            st = os.stat(parts[-1], dir_fd=at, follow_symlinks=False)
        except FileNotFoundError:
            return False
        finally:
            os.close(at)
        if stat.S_ISREG(st.st_mode):
            return True
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(f"{self._shown(name)} is a symbolic link: liferaft follows no link inside a "
                                  "checkpoint; put the file itself there")
        raise CorruptCheckpointError(f"{self._shown(name)} is {files.kind(st.st_mode)}, not a regular file")

    def list(self) -> list[str]:
        """Every name under the root: files, and links (a link to a folder is one name, never followed: its files
        are not this checkpoint's, and deleting it removes the link, never what it points to)."""
        out: list[str] = []
        top = self._top
        if not self._folder_ok():
            return out
        for dirpath, dirs, names in files.walk(top):
            rel = os.path.relpath(dirpath, top)
            for f in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
                out.append(f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}")
        return sorted(out)

    def _folder_ok(self) -> bool:
        """Whether the root is there as a folder (a child or sibling that is a link: UnsafePathError)."""
        try:
            os.close(files.open_folder(self._base, self._sub, self.root))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def has_files(self, budget: int = 10_000) -> bool:
        """Whether any file lies under the root, looking at ``budget`` entries at most (more: True): a
        ``load('/')`` must not walk the disk to say there is no checkpoint."""
        stack = [self._top] if self._folder_ok() else []
        seen = 0
        while stack:
            try:
                it = os.scandir(stack.pop())
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            with it:
                for e in it:
                    seen += 1
                    if seen > budget or not e.is_dir(follow_symlinks=False):
                        return True
                    stack.append(e.path)
        return False

    def delete(self, name: str) -> None:
        parts = self._rel(name).split("/")
        try:
            at = files.open_folder(self._base, parts[:-1], self._shown(name))
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            os.unlink(parts[-1], dir_fd=at)
        except FileNotFoundError:
            return
        finally:
            os.close(at)
        top = self._top
        parent = os.path.dirname(self._p(name))
        while parent != top and parent.startswith(top):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)

    def put_atomic(self, name: str, data: bytes) -> None:
        path = self._p(name)
        self._mkdirs(path)
        rel = self._rel(name)
        tmp = f"{rel}.tmp-{uuid.uuid4().hex[:12]}"
        fd, at = files.create_exclusive(self._base, tmp, replace=False)
        tname, fname = tmp.rsplit("/", 1)[-1], rel.rsplit("/", 1)[-1]
        try:
            try:
                view, done = memoryview(data).cast("B"), 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], done)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tname, fname, src_dir_fd=at, dst_dir_fd=at)   # replaces a link at fname, never its target
            except OSError as e:                            # (a folder there: IsADirectoryError)
                raise files.access_error(self._shown(name), e, "replace") from None
            os.fsync(at)
        except BaseException:
            try:
                os.unlink(tname, dir_fd=at)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(at)

    def sync(self) -> None:
        for d in sorted(self._dirty_dirs, key=len, reverse=True):
            if os.path.isdir(d):
                fsync_dir(d)
        self._dirty_dirs.clear()
