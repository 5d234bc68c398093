"""Executors that move tensor bytes between live tensors and storage, following a plan."""
