"""Dtype names (moved to ``liferaft.state.dtypes``; kept here for the chunk executors' imports)."""

from liferaft.state.dtypes import dtype_name, torch_dtype

__all__ = ["dtype_name", "torch_dtype"]
