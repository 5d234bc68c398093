"""Real ranks against a real S3-compatible server: save DTensor Shard(0) from 2 ranks, load Shard(1) on 3."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("obstore")
pytest.importorskip("moto")

from multiproc._reshard_ranks import SHAPES, load_rank, reference, save_rank

import liferaft
from liferaft.testing import run_ranks
from liferaft.testing.s3server import MotoS3Server


@pytest.fixture(scope="module")
def s3():
    with MotoS3Server() as server:
        yield server


def test_two_rank_shard0_save_to_s3_then_three_rank_shard1_load(s3, monkeypatch):
    url = f"s3://{s3.bucket}/ranks/ck"
    env = s3.env()                                   # the ranks find the server through AWS_ENDPOINT_URL
    written = run_ranks(save_rank, 2, url, {"kind": "dtensor", "mesh": (2,), "placements": ["S0"]}, env=env)
    assert all(w > 0 for w in written), written
    results = run_ranks(load_rank, 3, url, {"kind": "dtensor", "mesh": (3,), "placements": ["S1"]}, env=env)
    for rank, res in enumerate(results):
        assert all(res.values()), f"rank {rank}: mismatched {[k for k, v in res.items() if not v]}"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    liferaft.verify(url)
    tree = liferaft.read(url)
    for name in SHAPES:
        assert torch.equal(tree[name], reference(name))
    assert liferaft.inspect(url).world_size == 2


def test_memory_tier_drains_to_s3_and_a_job_that_lost_everything_else_restores_from_it(s3, tmp_path):
    import os
    import shutil
    import uuid

    from multiproc._tier_ranks import managed

    base = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"liferaft-s3t-{uuid.uuid4().hex[:8]}")
    root, remote = str(tmp_path / "root"), f"s3://{s3.bucket}/tiers"
    try:
        run_ranks(managed, 4, base, root, 2, 9, True, remote, timeout=180, env=s3.env())
        shutil.rmtree(base)
        shutil.rmtree(root)
        out = run_ranks(managed, 4, base, root, 2, 9, True, remote, timeout=180, env=s3.env())
        assert [o[:2] for o in out] == [(8, True)] * 4          # step 8 drained to S3 from memory, exact
    finally:
        shutil.rmtree(base, ignore_errors=True)
