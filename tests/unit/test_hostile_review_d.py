"""Hostile review D (crafted checkpoints against every reader), each finding as a class of input: manifest fields
whose types the decoder did not check (a per-rank tensor of no rank, a numpy or bytes value of a dtype numpy has
not, a ``lossy`` record with fields of other types), tagged values that repeat a key, metrics that are no numbers,
and keys that carry terminal escape sequences to the command's output. The DCP findings are in
test_hostile_foreign.py (DCP_CASES), the manager's in test_manager_rollback.py."""

from __future__ import annotations

import os

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft import CorruptCheckpointError
from liferaft.testing import tamper


def _refused_everywhere(path: str, match: str) -> None:
    for name, call in (("read", lambda: liferaft.read(path)), ("inspect", lambda: liferaft.inspect(path)),
                       ("verify", lambda: liferaft.verify(path))):
        with pytest.raises(CorruptCheckpointError, match=match):
            call()
            pytest.fail(f"{name} accepted {path}")
    r = liferaft_cli("read", path, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr


def _edit_tensor(path: str, key: str, **fields) -> None:
    def edit(doc):
        t = next(t for t in doc["tensors"] if t["key"] == key)
        t.update(fields)
    tamper.rewrite_manifest(path, edit)


@pytest.mark.parametrize("shape", [(0, 3), (2, 3)])
def test_a_per_rank_tensor_of_no_rank_is_refused(tmp_path, shape):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"e": torch.zeros(shape)})
    _edit_tensor(path, "e", per_rank=[])
    _refused_everywhere(path, "per_rank")


@pytest.mark.parametrize("kind,dtype,shape", [("numpy", torch.bfloat16, (4,)), ("numpy", torch.float8_e4m3fn, (4,)),
                                              ("bytes", torch.int32, (4,)), ("bytes", torch.uint8, (2, 2))])
def test_a_numpy_or_bytes_value_of_a_tensor_it_cannot_be_is_refused(tmp_path, kind, dtype, shape):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"w": torch.ones(shape).to(dtype)})
    _edit_tensor(path, "w", kind=kind)
    _refused_everywhere(path, f"kind '{kind}' cannot be")


@pytest.mark.parametrize("lossy", [{"method": "q8-block", "max_abs_error": "x"}, {"method": "selective", "from": 5},
                                   {"method": "selective", "from": [1, 2]}, {"method": "selective", "chunks": 1.5},
                                   {"method": "q8-block", "mean_abs_error": True}, {"method": "q8-block", "x": [1]}])
def test_a_lossy_record_with_fields_of_other_types_is_refused(tmp_path, lossy):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"w": torch.ones(4)})
    _edit_tensor(path, "w", lossy=lossy)
    _refused_everywhere(path, "lossy must be an object")
    with pytest.raises(CorruptCheckpointError):
        liferaft.load(path, {"w": torch.zeros(4)})


def test_the_lossy_records_liferaft_writes_still_load(tmp_path):
    path = str(tmp_path / "ck")
    st = {"w": torch.randn(256, 256)}
    liferaft.save(path, st, options=liferaft.SaveOptions(quantize=["w"]))
    got = {"w": torch.zeros(256, 256)}
    with pytest.warns(UserWarning, match="8-bit block quantization, max abs error"):
        res = liferaft.load(path, got)
    assert set(res.lossy) == {"w"} and (got["w"] - st["w"]).abs().max() < 0.1


@pytest.mark.parametrize("tagged", [{"$dict": [[1, "a"], [True, "b"], [1.0, "c"]]}, {"$dict": [["k", 1], ["k", 2]]},
                                    {"$set": [1, True]}, {"$frozenset": ["a", "a"]}])
def test_a_tagged_value_that_repeats_a_key_is_refused_not_merged(tmp_path, tagged):
    path = str(tmp_path / "ck")
    liferaft.save(path, {"w": torch.ones(1), "cfg": {1: "a"}})

    def edit(doc):
        next(v for v in doc["values"] if v["key"] == "cfg")["value"] = tagged
    tamper.rewrite_manifest(path, edit)
    with pytest.raises(CorruptCheckpointError, match="twice"):
        liferaft.read(path)


def test_metrics_that_are_no_numbers_rank_nothing(tmp_path):
    root = str(tmp_path / "root")
    os.makedirs(root)
    for step, m in [(1, {"loss": "x"}), (2, {"loss": 0.5}), (3, {"loss": True}), (4, {"loss": [1]}),
                    (5, {"loss": 0.7})]:
        liferaft.save(os.path.join(root, f"step-{step:010d}"), {"w": torch.ones(2)},
                      options=liferaft.SaveOptions(metadata={"step": step, "metrics": m}))
    for mode, best in (("min", 2), ("max", 5)):
        r = liferaft.gc(root, keep_best=1, metric="loss", mode=mode, dry_run=True)
        assert set(r.kept) == {best, 5}                     # the best numeric one, and the newest
    r = liferaft_cli("gc", root, "--keep-best", "1", "--metric", "loss", "--dry-run", timeout=120)
    assert r.returncode == 0, r.stderr


def test_keys_cannot_send_escape_sequences_to_the_terminal(tmp_path):
    from liferaft.cli.output import printable

    path = str(tmp_path / "ck")
    key = "w\x1b[8m hidden \x1b[0m\x1b]0;TITLE\x07\u202eevil\u2028"
    liferaft.save(path, {key: torch.ones(2), "plain ключ 鍵": torch.zeros(1)})
    for cmd in ("inspect", "read"):
        r = liferaft_cli(cmd, path, timeout=120)
        assert r.returncode == 0, r.stderr
        assert not any(c in r.stdout for c in "\x1b\x07\u202e\u2028"), r.stdout
        assert "\\x1b[8m" in r.stdout and "\\u202e" in r.stdout and "ключ 鍵" in r.stdout
    assert printable("a\tb\nc") == "a\tb\nc" and printable("\x1b\r") == "\\x1b\\r"
