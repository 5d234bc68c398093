"""What ``run_ranks``' fork server imports besides torch and liferaft, each only if it imports cleanly.

Imported once by the fork server (``launcher.PRELOAD``), so that ranks forked from it do not import these again:
``torch._dynamo`` (the first optimizer a process constructs imports it, with inductor, fx and onnx: ~0.6 CPU s
here), FSDP2 and DCP (what rank functions use besides), ``pytest`` (the module a rank function comes from is usually
a test module). The fork server skips only an ImportError in its preload list and dies on any other error (an
unwritable inductor cache folder raises OSError from ``torch._dynamo``), so any error here is swallowed: a rank
that needs the module then imports it itself and fails there with its own traceback.
"""

from __future__ import annotations

import contextlib
import importlib

OPTIONAL = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "pytest")

for _name in OPTIONAL:
    with contextlib.suppress(Exception):
        importlib.import_module(_name)
