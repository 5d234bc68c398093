"""Staging: snapshot copies of tensor bytes into a reused, budgeted buffer pool (pinned on CUDA)."""
