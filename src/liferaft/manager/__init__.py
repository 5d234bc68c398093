"""The checkpoint manager (when to save, what to keep, what to resume from), its option objects and its pure
policies. The public names (``CheckpointManager``, ``SavePolicy``, ``RetentionPolicy``, ``TierOptions``,
``PreemptionOptions``, ``JobOptions``, ``StepInfo``) are imported from ``liferaft``."""
