"""The native lifecycle: save, async save, load, read, and the commit protocol (``commit``); ``chunks`` moves
chunk bytes between live tensors and data files following a plan."""
