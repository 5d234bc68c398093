import os
import sys
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from liferaft.testing.s3server import MotoS3Server

# multi-process tests import their rank functions from this folder
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _own_probe_share(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's I/O-path probes are shared through a folder of its own (``iopath.HOST_DIR``), so what other
    tests or processes of this host measured never stands in for a probe a test looks at (ranks a test starts
    share through the default folder, as a job's ranks do)."""
    from liferaft.storage import iopath

    monkeypatch.setattr(iopath, "HOST_DIR", str(tmp_path_factory.mktemp("iopath-share")))


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


@pytest.fixture(scope="session")
def s3_server() -> Iterator["MotoS3Server"]:
    """One moto S3 server (a subprocess on 127.0.0.1) for the whole session, started on first use; each test takes
    its own prefix (``s3_prefix``). Skips when the ``test`` extra's obstore/moto are missing."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from liferaft.testing.s3server import MotoS3Server

    with MotoS3Server() as server:
        yield server


@pytest.fixture
def s3_prefix(s3_server: "MotoS3Server", monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://bucket/<fresh prefix>`` on the session's server, its endpoint and credentials in the environment."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def shm():
    """A fresh folder name in node-local shared memory (/dev/shm, else /tmp) for a memory tier, removed after."""
    import os
    import shutil
    import uuid

    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"liferaft-test-{uuid.uuid4().hex[:8]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)
