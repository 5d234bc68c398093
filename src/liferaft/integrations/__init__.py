"""liferaft as the checkpoint engine of the frameworks users train with (docs/INTEGRATIONS.md).

Each integration is its own module and imports its framework when it is imported: ``import liferaft`` imports none
of them. ``liferaft.integrations.lightning``: ``LiferaftCheckpointIO``, a PyTorch Lightning ``CheckpointIO``, and
``LiferaftModelParallelStrategy`` for FSDP2 / tensor parallelism;
``liferaft.integrations.accelerate``: ``save_state`` / ``load_state`` of a Hugging Face ``Accelerator``;
``liferaft.integrations.transformers``: ``LiferaftCallback``, the Hugging Face ``Trainer``'s checkpoints through a
callback; ``liferaft.integrations.torchtitan``: ``LiferaftCheckpointManager``, torchtitan's checkpoint manager.
"""
