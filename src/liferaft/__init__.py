"""liferaft: checkpoints that let distributed PyTorch training survive failures.

The public API is this module's ``__all__`` (grouped below, each name documented in docs/API.md) and the public
modules ``liferaft.errors`` (every error), ``liferaft.options`` (the options and result types, and the ``Literal``
types of their string options), ``liferaft.storage`` (the storage backends: ``resolve``, ``Storage``),
``liferaft.data`` (the data-position sampler), ``liferaft.integrations.lightning`` and
``liferaft.integrations.accelerate`` (framework integrations, each importing its framework) and
``liferaft.testing`` (test helpers). Everything else is private
and may change. The package is typed (``py.typed``).
"""

from liferaft.core.load import load
from liferaft.core.open import format_of
from liferaft.core.read import CheckpointInfo, ContainerInfo, TensorInfo, VerifyReport, inspect, read, verify
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
from liferaft.manager.checkfree import StageRebuild, rebuild_stage
from liferaft.manager.manager import CheckpointManager, StepInfo
from liferaft.manager.options import JobOptions, PreemptionOptions, StepLogOptions, TierOptions
from liferaft.manager.policies import RetentionPolicy, SavePolicy
from liferaft.options import LoadOptions, LoadResult, SaveOptions, SaveResult
from liferaft.rendezvous import init_process_group
from liferaft.state.rng import RNGState
from liferaft.state.sharded import Sharded
from liferaft.state.values import PerRank
from liferaft.tiers.memory import MemoryTier
from liferaft.tools.convert import ConvertReport, convert, find_model
from liferaft.tools.diff import DiffReport, KeyDiff, diff
from liferaft.tools.stats import KeyInfo, describe
from liferaft.tools.steps import GcReport, gc, ls

__version__ = "0.1.0"

#: The public names, in the groups of docs/API.md (tests/unit/test_public_api.py holds the two to each other).
__all__ = [  # noqa: RUF022 (grouped as docs/API.md, not sorted)
    # Save and load: the collective entry points, their options and what they report
    "save", "async_save", "AsyncSaveHandle", "load", "SaveOptions", "LoadOptions", "SaveResult", "LoadResult",
    # What a state may hold besides tensors, modules, optimizers and plain values
    "Sharded", "RNGState", "PerRank",
    # Look into a checkpoint in one process: read, summarize, verify, per-key storage view
    "read", "inspect", "verify", "format_of", "describe", "CheckpointInfo", "TensorInfo", "ContainerInfo",
    "VerifyReport", "KeyInfo",
    # Training runs: the manager and its option objects, the memory tier, a root's steps from outside a job
    "CheckpointManager", "SavePolicy", "RetentionPolicy", "TierOptions", "PreemptionOptions", "JobOptions",
    "StepLogOptions",
    "StepInfo", "MemoryTier", "init_process_group", "rebuild_stage", "StageRebuild", "ls", "gc", "GcReport",
    # Compare and convert checkpoints of any format
    "diff", "DiffReport", "KeyDiff", "convert", "ConvertReport", "find_model",
    # What liferaft keeps in the process between calls
    "release", "release_groups",
    # Errors (all in liferaft.errors; every one a LiferaftError)
    "LiferaftError", "CheckpointNotFoundError", "IncompleteCheckpointError", "CheckpointExistsError",
    "CheckpointBusyError", "CorruptCheckpointError", "FormatVersionError", "UnsafePathError", "StateMismatchError",
    "LossyCheckpointError", "InvalidStateError", "PickleNotAllowedError", "OptionsError", "DistributedError",
    "StorageError", "ReadOnlyRootError",
    # The package's version
    "__version__",
]
