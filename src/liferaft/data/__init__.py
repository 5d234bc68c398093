"""Data position that survives a change of the data-parallel size (``GlobalSampler``)."""

from liferaft.data.sampler import GlobalSampler, Sample, global_order

__all__ = ["GlobalSampler", "Sample", "global_order"]
