import os
import sys

import pytest

# multi-process tests import their rank functions from this folder
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(params=["file", "memory"])
def backend_path(request, tmp_path):
    """The same test against each storage backend that works in one process."""
    if request.param == "file":
        yield str(tmp_path / "ckpt")
    else:
        from liferaft.storage.memory import drop_memory_store

        name = f"test-{os.getpid()}-{request.node.name}"
        yield f"memory://{name}"
        drop_memory_store(name)
