"""The one place liferaft opens local files: by a relative name under a root, never through a link below it.

A root is a folder the caller chose (a checkpoint, a DCP folder, an export destination): it is resolved once
(``os.path.realpath``: links above it are the user's business). Below it, every folder on the way is opened with
``O_NOFOLLOW | O_DIRECTORY`` relative to the one before, and the file itself ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO
cannot hang the open), then ``fstat``-ed: only regular files are read, and their size is checked against the
caller's cap before a byte is read. Writes create their files exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``), in
folders walked the same way: nothing is ever written through a link.

Refusals are ``LiferaftError``s naming the file: ``UnsafePathError`` for a link (or a name leaving the root),
``CorruptCheckpointError`` for a file that is not a regular file or is larger than the cap (``error=`` picks
another class for both, e.g. ``OptionsError`` for a file named on a command line). A missing file (or a missing
folder on the way) stays ``FileNotFoundError``, as the storage contract says.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence

from liferaft.errors import CorruptCheckpointError, FileAccessError, UnsafePathError
from liferaft.format.limits import MAX_NAME_BYTES, name_bytes

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC


def kind(mode: int) -> str:
    """What a file of ``mode`` is, in words (for messages)."""
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a folder" if stat.S_ISDIR(mode) else
            "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file")


def parts_of(rel: str, where: str) -> list[str]:
    """The components of the relative name ``rel`` (``/``-separated); UnsafePathError for an absolute name, an
    empty, ``.`` or ``..`` component, or a NUL."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise UnsafePathError(f"{where}: {rel!r} is not a plain relative file name (absolute, or with an empty, '.' "
                              "or '..' component): liferaft reads nothing outside the checkpoint")
    if any(name_bytes(p) > MAX_NAME_BYTES for p in parts):
        raise UnsafePathError(f"{where}: {rel[:80]!r}... has a component longer than {MAX_NAME_BYTES} bytes, which "
                              "no file system holds: a damaged or crafted name")
    return parts


#: what to do, by errno, for a file that cannot be opened (the rest: "check the file and its folder")
_ADVICE = {errno.EACCES: "permission denied: grant read (and, to write, write) access to it and its folders",
           errno.EPERM: "operation not permitted: check its permissions and attributes",
           errno.ENAMETOOLONG: f"a name longer than {MAX_NAME_BYTES} bytes (or the whole path too long): use a "
                               "shorter one",
           errno.ELOOP: "a symbolic link, or too many levels of them: liferaft follows no link inside a checkpoint",
           errno.EISDIR: "a folder is where a file belongs: remove it or choose another name",
           errno.ENOTEMPTY: "a folder is where a file belongs: remove it or choose another name",
           errno.EEXIST: "something is already there: remove it or choose another name",
           errno.EXDEV: "the temporary file and the destination lie on different file systems",
           errno.EMFILE: "too many open files in this process: raise the limit (ulimit -n) or close some",
           errno.ENFILE: "too many open files on this system",
           errno.EROFS: "a read-only file system: choose a writable destination",
           errno.ENOSPC: "no space left on the device",
           errno.EDQUOT: "the disk quota is exceeded",
           errno.ENXIO: "a special file with nothing behind it (e.g. a socket or a FIFO without a writer)",
           errno.EIO: "the device reported an I/O error: check the disk (dmesg), and load another copy (an "
                      "earlier step, a replica, another tier) if this one stays unreadable"}


def access_error(shown: str, e: OSError, doing: str = "open") -> OSError:
    """``e`` (an OSError of an operation on the file shown as ``shown``) as the error liferaft raises: a missing
    file stays FileNotFoundError, a file where a folder belongs NotADirectoryError (the storage contract), EINVAL
    stays as it is (how ``O_DIRECT`` is refused); any other errno is a FileAccessError naming the file, saying what
    went wrong and what to do, with the same ``errno``."""
    if isinstance(e, (FileNotFoundError, NotADirectoryError, FileAccessError)) or e.errno in (None, errno.EINVAL):
        return e
    advice = _ADVICE.get(e.errno, f"{e.strerror or e}: check the file and its folder")
    return FileAccessError(e.errno, f"{shown}: cannot {doing} it ({advice})")


def _refuse(at: int, name: str, shown: str, e: OSError, error: type[Exception] | None) -> BaseException:
    """The error for an ``openat`` of ``name`` in folder ``at`` that failed with ``e``: a link is refused, a
    missing name stays FileNotFoundError (NotADirectoryError for a file on the way), anything else is ``e``."""
    try:
        st = os.stat(name, dir_fd=at, follow_symlinks=False)
    except OSError:
        return access_error(shown, e)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(name, dir_fd=at)
        return (error or UnsafePathError)(
            f"{shown} is a symbolic link (to {target!r}): liferaft follows no link inside a checkpoint, so nothing "
            "outside it is read or written; put the file itself there")
    if e.errno == errno.ENOTDIR:
        return NotADirectoryError(e.errno, f"{shown}: {kind(st.st_mode)} is where a folder should be")
    return access_error(shown, e)


def open_root(root: str) -> int:
    """The folder ``root`` opened (links in ``root`` itself are followed: it is the caller's path)."""
    try:
        return os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    except OSError as e:
        raise access_error(root, e) from None


def walk(top: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(top)`` (top-down; links to folders listed among the folders, never entered; a folder that cannot
    be listed skipped) without recursion: a crafted tree thousands of folders deep is walked like any other
    (``os.walk`` recurses on Python 3.10 and 3.11: RecursionError)."""
    stack = [top]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        dirs, names = [], []
        for e in entries:
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            (dirs if is_dir else names).append(e.name)
        yield folder, dirs, names
        stack.extend(os.path.join(folder, d) for d in reversed(dirs) if not os.path.islink(os.path.join(folder, d)))


def open_folder(root: str, parts: Sequence[str], shown: str | None = None, *, create: bool = False,
                error: type[Exception] | None = None) -> int:
    """The folder ``root/parts...`` opened without following a link below ``root`` (made when ``create``)."""
    fd = open_root(root)
    done: list[str] = []
    try:
        for p in parts:
            done.append(p)
            if create:
                try:
                    os.mkdir(p, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise access_error(os.path.join(root, *done), e, "create") from None
            try:
                nxt = os.open(p, _DIR, dir_fd=fd)
            except OSError as e:
                folder = os.path.join(root, *done)      # the folder is what the message names, not the file
                if shown and shown != folder:
                    folder += f" (a folder on the way to {shown})"
                raise _refuse(fd, p, folder, e, error) from None
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_read(root: str, rel: str, *, limit: int | None = None, direct: bool = False,
              error: type[Exception] | None = None, shown: str | None = None, folder: int | None = None) -> int:
    """A descriptor of the regular file ``root/rel`` open for reading (blocking), no link followed below ``root``
    and its size at most ``limit``. ``direct`` adds ``O_DIRECT`` (EINVAL from a file system without it is
    raised as it is). ``shown`` names the file in messages (default: its path). ``folder``: the descriptor of
    ``rel``'s folder, already opened (``open_folder``; kept open): the file is opened in it."""
    parts = parts_of(rel, root)
    shown = shown or os.path.join(root, *parts)
    at = open_folder(root, parts[:-1], shown, error=error) if folder is None else folder
    try:
        flags = os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(parts[-1], flags, dir_fd=at)
        except OSError as e:
            raise _refuse(at, parts[-1], shown, e, error) from None
    finally:
        if folder is None:
            os.close(at)
    return _checked(fd, shown, limit, error)


def check_fd(fd: int, shown: str, limit: int | None = None, error: type[Exception] | None = None) -> int:
    """The size of the open file ``fd``, which must be a regular file of at most ``limit`` bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise (error or CorruptCheckpointError)(
            f"{shown} is {kind(st.st_mode)}, not a regular file: liferaft reads only regular files (remove it, "
            "or put the file itself there)")
    if limit is not None and st.st_size > limit:
        raise (error or CorruptCheckpointError)(
            f"{shown} holds {st.st_size} bytes, more than the {limit} liferaft reads of such a file; it is "
            "damaged or not what its name says")
    return st.st_size


def open_path(path: str, *, limit: int | None = None, error: type[Exception] | None = None,
              shown: str | None = None) -> int:
    """A file named by the user (links in ``path`` are the user's): opened without blocking on a FIFO, then
    checked as ``open_read`` does (a regular file of at most ``limit`` bytes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC)
    except IsADirectoryError:
        raise (error or CorruptCheckpointError)(f"{shown or path} is a folder, not a regular file") from None
    except OSError as e:
        raise access_error(shown or path, e) from None
    return _checked(fd, shown or path, limit, error)


def _checked(fd: int, shown: str, limit: int | None, error: type[Exception] | None) -> int:
    """``fd`` (opened without blocking) back in blocking mode once ``check_fd`` accepts it; closed if not."""
    try:
        check_fd(fd, shown, limit, error)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def pread_full(fd: int, out: memoryview, offset: int) -> int:
    """Read into ``out`` from ``offset`` of ``fd`` until it is full or the file ends; the bytes read."""
    total = 0
    while total < len(out):
        n = os.preadv(fd, [out[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def read_fd(fd: int, shown: str, limit: int | None = None, error: type[Exception] | None = None) -> bytes:
    """The whole content of the open regular file ``fd`` (size from ``fstat``, at most ``limit``): a file that
    grows while it is read is refused rather than read without end."""
    size = check_fd(fd, shown, limit, error)
    cap = size if limit is None else min(size, limit)
    chunks, got = [], 0
    while True:
        piece = os.pread(fd, max(cap + 1 - got, 1), got)
        if not piece:
            break
        chunks.append(piece)
        got += len(piece)
        if got > cap:
            raise (error or CorruptCheckpointError)(
                f"{shown} grew past {cap} bytes while it was read; liferaft reads a file as large as it was "
                "when opened")
    return b"".join(chunks)


def read_capped(root: str, rel: str, limit: int | None = None, *, error: type[Exception] | None = None,
                shown: str | None = None) -> bytes:
    """The bytes of the regular file ``root/rel`` (``open_read``), at most ``limit`` of them."""
    fd = open_read(root, rel, limit=limit, error=error, shown=shown)
    try:
        return read_fd(fd, shown or os.path.join(root, rel), limit, error)
    finally:
        os.close(fd)


def create_exclusive(root: str, rel: str, *, replace: bool = True, mkdirs: bool = True,
                     error: type[Exception] | None = None, readable: bool = False) -> tuple[int, int]:
    """(a descriptor of the new file ``root/rel`` open for writing — and reading, with ``readable``: a file to
    map into memory —, a descriptor of its folder): created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` in folders opened without following links (made when ``mkdirs``). With
    ``replace``, whatever lies at the name first (an older file, a planted link: the link itself, never its
    target) is removed; without it, FileExistsError. The caller closes both."""
    parts = parts_of(rel, root)
    shown = os.path.join(root, *parts)
    at = open_folder(root, parts[:-1], shown, create=mkdirs, error=error)
    try:
        flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        try:
            try:
                fd = os.open(parts[-1], flags, 0o644, dir_fd=at)
            except FileExistsError:
                if not replace:
                    raise
                if stat.S_ISDIR(os.stat(parts[-1], dir_fd=at, follow_symlinks=False).st_mode):
                    raise FileAccessError(errno.EISDIR, f"{shown}: a folder is where a file is to be written "
                                          "(remove it or choose another destination)") from None
                os.unlink(parts[-1], dir_fd=at)
                fd = os.open(parts[-1], flags, 0o644, dir_fd=at)
        except OSError as e:
            if isinstance(e, FileAccessError) or (isinstance(e, FileExistsError) and not replace):
                raise
            raise access_error(shown, e, "create") from None
        return fd, at
    except BaseException:
        os.close(at)
        raise


def lexists_plain(root: str, rel: str) -> bool:
    """Whether anything (a file, a link, a folder) is at ``root/rel``, folders on the way not followed."""
    parts = parts_of(rel, root)
    try:
        at = open_folder(root, parts[:-1])
    except (FileNotFoundError, NotADirectoryError, UnsafePathError):
        return False
    try:
        os.stat(parts[-1], dir_fd=at, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(at)


def plain_component(name: object) -> bool:
    """A file or folder name of one component: a non-empty str without ``/``, ``\\`` or NUL, not ``.``/``..``."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
            and len(name.encode("utf-8", "surrogateescape")) <= 255)


def check_target(path: str) -> None:
    """Refuse, before anything is written, a destination file ``path`` that a rename could not replace: a folder
    is there (FileAccessError naming it and what to do)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return
    if stat.S_ISDIR(st.st_mode):
        raise FileAccessError(errno.EISDIR, f"{path}: a folder is where the file is to be written (remove it or "
                                            "choose another destination)")


def put_in_place(tmp: str, dst: str, *, dir_fd: int | None = None, shown: str | None = None) -> None:
    """Rename the finished temporary file ``tmp`` to ``dst`` (both in the folder ``dir_fd`` when given), replacing
    a file or a link there (never writing through it). On failure ``tmp`` is removed and the error is a
    FileAccessError naming the destination and what to do (a folder in the way, permissions, ...)."""
    try:
        os.replace(tmp, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise access_error(shown or dst, e, "write") from None
