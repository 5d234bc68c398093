"""Checkpoint tiers: node-local shared memory with peer replicas (``memory``)."""
