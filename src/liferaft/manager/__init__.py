"""The checkpoint manager (when to save, what to keep, what to resume from), its option objects and its pure
policies: ``CheckpointManager(root, every_steps=..., keep_last=..., save_policy=SavePolicy(...),
retention=RetentionPolicy(...), tiers=TierOptions(...), preemption=PreemptionOptions(...), job=JobOptions(...))``."""

from liferaft.manager.listing import StepInfo
from liferaft.manager.manager import CheckpointManager
from liferaft.manager.options import JobOptions, PreemptionOptions, TierOptions
from liferaft.manager.policies import RetentionPolicy, SavePolicy

__all__ = ["CheckpointManager", "JobOptions", "PreemptionOptions", "RetentionPolicy", "SavePolicy", "StepInfo",
           "TierOptions"]
