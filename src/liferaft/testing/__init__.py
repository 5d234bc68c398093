"""Helpers for testing code that uses liferaft (shipped for users too): a multi-process launcher."""

from liferaft.testing.launcher import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
