"""Every error liferaft raises on purpose is a :class:`LiferaftError`.

Each message says what happened, to which key or file, and what to do about it.
"""

from __future__ import annotations


class LiferaftError(Exception):
    """Base class of all liferaft errors."""


class CheckpointNotFoundError(LiferaftError):
    """Nothing (no commit marker, no files) exists at the given path."""


class IncompleteCheckpointError(LiferaftError):
    """The path holds checkpoint files but no commit marker: a save did not finish."""


class CheckpointExistsError(LiferaftError):
    """A save targets a path that already holds a committed checkpoint (pass overwrite=True); or a manager's save
    would go behind the root's newest step without a rollback, or its rollback would remove a pinned step."""


class CorruptCheckpointError(LiferaftError):
    """Stored bytes do not match their checksum, a file is truncated or the manifest is damaged."""


class FormatVersionError(LiferaftError):
    """The checkpoint was written by a newer (or unknown) format version."""


class UnsafePathError(LiferaftError):
    """A path in a manifest would leave the checkpoint directory."""


class StateMismatchError(LiferaftError):
    """The state passed to load does not match the checkpoint (missing/unexpected keys, shape, dtype)."""


class InvalidStateError(LiferaftError):
    """The state passed to save cannot be saved as given (overlapping shards, unsupported objects, ...)."""


class PickleNotAllowedError(InvalidStateError):
    """A value would need pickle but pickle was not allowed by the options."""


class DistributedError(LiferaftError):
    """Another rank failed, or a collective timed out. The message names the rank and its error."""


class CheckpointBusyError(LiferaftError):
    """A save was asked for while an async save of this process was in flight and ``if_busy="raise"``; or the
    root's lease is held by another job (or another live process), or was lost to one."""


class OptionsError(LiferaftError, ValueError):
    """An options object holds an invalid setting."""


class StorageError(LiferaftError):
    """The storage backend failed (I/O error, unknown URL scheme, ...)."""


class FileAccessError(StorageError, OSError):
    """A local file or folder could not be opened or put in place (permission denied, a name too long, a folder
    where a file belongs, too many open files, ...): the message names it and says what to do. Also an
    ``OSError`` with the ``errno`` of the failure, for code that tells them apart."""

    def __str__(self) -> str:
        return str(self.strerror) if self.strerror else super().__str__()


class ReadOnlyRootError(StorageError):
    """A CheckpointManager root cannot be written (read-only file system, no write permission, PUT denied): the
    manager can restore from it and list its steps, but not save, pin or delete there."""


class LossyCheckpointError(StateMismatchError):
    """The checkpoint stores some loaded tensor lossily (quantized, or from an older step) and the load asked
    for an exact resume (``LoadOptions(exact=True)``)."""
