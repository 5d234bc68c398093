"""A CheckpointManager root that cannot be written restores (no lease needed to read) and refuses to save with
ReadOnlyRootError; a root that is not a directory is refused at construction. Real read-only conditions: a
read-only bind mount (needs mount privileges: skipped without), and an S3 server that denies writes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest
import torch

from liferaft import CheckpointManager, JobOptions, PreemptionOptions, ReadOnlyRootError, StorageError

NO_SIGNALS = PreemptionOptions(signals=())        # these managers never install handlers


def _state(value: float) -> dict:
    return {"w": torch.full((64,), value), "b": torch.arange(8.0) * value}


def _writer_saves(root, steps=(0, 1), **kw) -> CheckpointManager:
    """A manager that saved ``steps`` and stays open (its job still runs: it holds the lease)."""
    mgr = CheckpointManager(root, async_save=False, preemption=NO_SIGNALS, **kw)
    for s in steps:
        mgr.save(s, _state(float(s)))
    return mgr


def _check_restores_but_does_not_save(mgr: CheckpointManager, where: str) -> None:
    assert mgr.read_only
    state = _state(-1.0)
    assert mgr.restore(state) == 1
    assert torch.equal(state["w"], _state(1.0)["w"]) and torch.equal(state["b"], _state(1.0)["b"])
    assert mgr.restore(state, step=0) == 0 and torch.equal(state["w"], _state(0.0)["w"])
    assert [(i.step, i.status) for i in mgr.steps() if i.status == "committed"] == [(0, "committed"), (1, "committed")]
    for attempt in (lambda: mgr.maybe_save(5, state, force=True), lambda: mgr.save(5, state), lambda: mgr.pin(1)):
        with pytest.raises(ReadOnlyRootError, match="read-only") as e:
            attempt()
        assert where in str(e.value) and "restore" in str(e.value)
    mgr.close()


@pytest.fixture
def read_only_view(tmp_path):
    """(a writable folder, a read-only bind mount of it)."""
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    if subprocess.run(["mount", "--bind", str(rw), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs CAP_SYS_ADMIN)")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only here")
        yield str(rw), str(ro)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_a_read_only_mount_of_a_root_in_use_restores_at_once(read_only_view):
    rw, ro = read_only_view
    writer = _writer_saves(os.path.join(rw, "run"), job=JobOptions(lease_ttl=5.0))       # the training job, still running
    try:
        os.makedirs(os.path.join(rw, "run", "step-0000000002"))           # its save in flight: no commit marker
        with open(os.path.join(rw, "run", "step-0000000002", "data"), "wb") as f:
            f.write(b"x")
        t0 = time.monotonic()
        reader = CheckpointManager(os.path.join(ro, "run"), preemption=NO_SIGNALS)    # an evaluation job
        assert time.monotonic() - t0 < 3.0                    # it does not wait for the writer's lease
        assert reader.job_id != writer.job_id
        _check_restores_but_does_not_save(reader, os.path.join(ro, "run"))
        assert os.path.exists(os.path.join(rw, "run", "step-0000000002", "data"))
        writer.save(3, _state(3.0))                           # the writer never noticed
    finally:
        writer.close()
    # a root that does not exist yet under a read-only folder: nothing to restore, no saving
    mgr = CheckpointManager(os.path.join(ro, "new-run"), preemption=NO_SIGNALS)
    assert mgr.read_only and mgr.restore(_state(0.0)) is None
    with pytest.raises(ReadOnlyRootError, match="read-only file system"):
        mgr.save(0, _state(0.0))
    mgr.close()


def test_a_root_that_is_a_regular_file_is_refused_at_construction(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a folder")
    with pytest.raises(StorageError, match=f"{path}: the root is not a directory") as e:
        CheckpointManager(str(path))
    assert not isinstance(e.value, OSError)
    with pytest.raises(StorageError, match=f"{path}, a folder above the root, is not a directory"):
        CheckpointManager(str(path / "run"))
    assert path.read_text() == "not a folder"


def test_an_s3_root_where_writes_are_denied_restores(monkeypatch):
    pytest.importorskip("moto")
    pytest.importorskip("obstore")
    from liferaft.storage.s3 import S3Storage
    from liferaft.testing.s3server import FaultProxy, MotoS3Server

    with MotoS3Server() as server, FaultProxy(server.endpoint_url) as proxy:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{server.bucket}/{uuid.uuid4().hex[:10]}"
        proxy.fail_next(None, status=403, methods={"PUT", "POST", "DELETE"})       # a read-only policy
        writer = _writer_saves(S3Storage(url), job=JobOptions(lease_ttl=5.0))
        try:
            t0 = time.monotonic()                 # a live writer's lease: the reader finds out by a refused PUT
            reader = CheckpointManager(S3Storage(url, endpoint_url=proxy.url), preemption=NO_SIGNALS)
            assert time.monotonic() - t0 < 3.0
            _check_restores_but_does_not_save(reader, url)
        finally:
            writer.close()
        reader = CheckpointManager(S3Storage(url, endpoint_url=proxy.url), preemption=NO_SIGNALS)    # no lease
        _check_restores_but_does_not_save(reader, url)
        assert {r.outcome for r in proxy.requests if r.method == "PUT"} == {"403"}
