"""One-process tools on checkpoints and manager roots: list, garbage-collect, compare (the ``liferaft`` command's
library side)."""
