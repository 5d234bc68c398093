"""liferaft: checkpoints that let distributed PyTorch training survive failures.

The public API is this module's ``__all__``; everything else is private and may change. (``liferaft.data`` holds
the data-position sampler; ``liferaft.storage`` and ``liferaft.testing`` the backends and test helpers.)
"""

from liferaft.core.load import load
from liferaft.core.read import CheckpointInfo, PerRank, TensorInfo, VerifyReport, inspect, read, verify
from liferaft.core.save import AsyncSaveHandle, async_save, release, save
from liferaft.dist import release_groups
from liferaft.errors import (
                             CheckpointBusyError,
                             CheckpointExistsError,
                             CheckpointNotFoundError,
                             CorruptCheckpointError,
                             DistributedError,
                             FormatVersionError,
                             IncompleteCheckpointError,
                             InvalidStateError,
                             LiferaftError,
                             LossyCheckpointError,
                             OptionsError,
                             PickleNotAllowedError,
                             ReadOnlyRootError,
                             StateMismatchError,
                             StorageError,
                             UnsafePathError,
)
from liferaft.manager.manager import CheckpointManager, StepInfo
from liferaft.options import LoadOptions, LoadResult, SaveOptions, SaveResult
from liferaft.state.rng import RNGState
from liferaft.state.sharded import Sharded
from liferaft.tiers.memory import MemoryTier
from liferaft.tools.convert import ConvertReport, convert
from liferaft.tools.diff import DiffReport, diff
from liferaft.tools.stats import describe
from liferaft.tools.steps import GcReport, gc, ls

__version__ = "0.1.0"

__all__ = [
    "save", "async_save", "AsyncSaveHandle", "load", "read", "inspect", "verify", "release", "release_groups",
    "convert", "diff", "describe", "ls", "gc", "ConvertReport", "DiffReport", "GcReport",
    "CheckpointManager", "StepInfo", "MemoryTier", "Sharded", "RNGState",
    "SaveOptions", "LoadOptions", "SaveResult", "LoadResult", "CheckpointInfo", "TensorInfo", "VerifyReport", "PerRank",
    "LiferaftError", "CheckpointNotFoundError", "IncompleteCheckpointError", "CheckpointExistsError",
    "CheckpointBusyError", "CorruptCheckpointError", "FormatVersionError", "UnsafePathError", "StateMismatchError",
    "InvalidStateError", "PickleNotAllowedError", "OptionsError", "DistributedError", "StorageError",
    "ReadOnlyRootError", "LossyCheckpointError",
    "__version__",
]
