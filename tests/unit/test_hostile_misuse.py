"""API misuse caught up front, and a command line that never prints a traceback (issue #16, class 6).

Loads check every destination before the first byte is written; states that contain themselves or nest too deep,
options of the wrong type or range, paths that are not paths: a LiferaftError naming what is wrong, at the entry.
The ``liferaft`` command: one error line (exit 1) or a usage error (exit 2), and output linear in the keys.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch

import liferaft
from liferaft import InvalidStateError, LiferaftError, LoadOptions, OptionsError, SaveOptions
from liferaft.cli import main
from liferaft.core.aliasing import has_internal_overlap
from liferaft.format.limits import MAX_NESTING
from liferaft.state.tree import nest


def _bits(state):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _same(state, before):
    return all(torch.equal(state[k].view(torch.uint8) if state[k].numel() else state[k], before[k].view(torch.uint8)
                           if before[k].numel() else before[k]) for k in before)


@pytest.fixture
def small(tmp_path):
    path = str(tmp_path / "small")
    liferaft.save(path, {"a": torch.ones(4), "b": torch.ones(4, 4), "c": torch.ones(3)})
    return path


def _inference(shape):
    with torch.inference_mode():
        return torch.zeros(shape)


BAD_DESTINATIONS = {
    "expanded": lambda: torch.zeros(1, 4).expand(4, 4),
    "as_strided_overlap": lambda: torch.zeros(10).as_strided((4, 4), (2, 1)),
    "stride0_inner": lambda: torch.zeros(4, 1).expand(4, 4),
    "inference": lambda: _inference((4, 4)),
}


@pytest.mark.parametrize("kind", sorted(BAD_DESTINATIONS))
def test_load_refuses_an_unwritable_destination_before_any_byte(small, kind):
    state = {"a": torch.zeros(4), "b": BAD_DESTINATIONS[kind](), "c": torch.zeros(3)}
    before = {k: v.clone() for k, v in state.items()}
    with pytest.raises(InvalidStateError, match="'b'"):
        liferaft.load(small, state)
    assert torch.equal(state["a"], before["a"]) and torch.equal(state["c"], before["c"])    # nothing written
    assert torch.equal(state["b"], before["b"])


def test_load_into_overlap_free_views_still_works(small):
    base = torch.zeros(100)
    state = {"a": torch.zeros(8)[::2], "b": base.as_strided((4, 4), (1, 4)), "c": torch.zeros(3, 2)[:, 0]}
    liferaft.load(small, state)
    assert all(bool((v == 1).all()) for v in state.values()) and float(base.sum()) == 16


def _overlaps_brute(shape, stride):
    seen = set()
    for idx in itertools.product(*(range(n) for n in shape)):
        off = sum(i * s for i, s in zip(idx, stride))
        if off in seen:
            return True
        seen.add(off)
    return False


def test_overlap_check_is_exact():
    """Against brute force over every small shape and stride: no false alarm, no miss."""
    for shape in itertools.product(range(4), repeat=2):
        for stride in itertools.product(range(7), repeat=2):
            t = torch.zeros(64).as_strided(shape, stride)
            assert has_internal_overlap(t) == _overlaps_brute(shape, stride), (shape, stride)
    for shape, stride in [((2, 3, 2), (6, 2, 1)), ((2, 3, 2), (5, 2, 1)), ((2, 2, 2), (1, 4, 2)), ((3, 2, 2), (4, 1, 2))]:
        t = torch.zeros(64).as_strided(shape, stride)
        assert has_internal_overlap(t) == _overlaps_brute(shape, stride), (shape, stride)


# ------------------------------------------------------------------------------------ self-containing, too deep

class _HoldsItself:
    def state_dict(self):
        return {"me": self, "t": torch.zeros(1)}

    def load_state_dict(self, sd):
        pass


def _cyclic_states():
    d = {"t": torch.zeros(2)}
    d["self"] = d
    lst = [torch.zeros(2)]
    lst.append(lst)
    v = {"x": 1}
    v["me"] = v
    deep = torch.zeros(1)
    for _ in range(5000):
        deep = {"a": deep}
    deep_value = 1
    for _ in range(5000):
        deep_value = [deep_value]
    return {"dict": d, "list": {"l": lst}, "value": {"t": torch.zeros(1), "v": v}, "deep_tensor": {"x": deep},
            "deep_value": {"t": torch.zeros(1), "v": deep_value}, "stateful": {"s": _HoldsItself()}}


@pytest.mark.parametrize("case", sorted(_cyclic_states()))
@pytest.mark.parametrize("call", ["save", "async_save", "load", "manager"])
def test_self_containing_and_too_deep_states_are_refused(tmp_path, small, case, call):
    state = _cyclic_states()[case]
    if call == "load" and case == "value":
        pytest.skip("a plain value of the state is replaced by a load, not walked: holding itself is harmless")
    with pytest.raises(InvalidStateError, match="contains itself|deeper than"):
        if call == "save":
            liferaft.save(str(tmp_path / "x"), state)
        elif call == "async_save":
            liferaft.async_save(str(tmp_path / "x"), state).wait()
        elif call == "load":
            liferaft.load(small, state)
        else:
            with liferaft.CheckpointManager(str(tmp_path / "root"), every_steps=1, async_save=False) as m:
                m.save(1, state)
    assert not (tmp_path / "x").exists() or not (tmp_path / "x" / "COMMIT").exists()


def test_nesting_at_the_limit_round_trips(tmp_path):
    value = 1
    for _ in range(MAX_NESTING - 2):
        value = [value]
    liferaft.save(str(tmp_path / "x"), {"t": torch.zeros(1), "v": value})
    assert liferaft.read(str(tmp_path / "x"))["v"] == value


def test_tree_of_very_long_key_paths_without_recursion():
    path = tuple(f"p{i}" for i in range(5000))
    tree = nest({path: 1})
    for part in path:
        tree = tree[part]
    assert tree == 1


# ----------------------------------------------------------------------------------------------- options

@pytest.mark.parametrize("kw", [dict(timeout=-5), dict(timeout=0), dict(timeout=math.nan), dict(timeout=math.inf),
                                dict(timeout="5"), dict(timeout=True), dict(max_read_bytes=0),
                                dict(max_read_bytes=1.5), dict(max_read_bytes=True), dict(max_read_bytes=1 << 60),
                                dict(atomic="yes"), dict(share_reads=1), dict(allow_pickle=1), dict(exact=None)])
def test_load_options_checked_on_construction(kw):
    with pytest.raises(OptionsError, match=f"LoadOptions.{next(iter(kw))}"):
        LoadOptions(**kw)


@pytest.mark.parametrize("kw", [dict(timeout=-5), dict(timeout=0), dict(timeout=math.inf), dict(overwrite="no"),
                                dict(chunk_bytes="1e6"), dict(chunk_bytes=True), dict(chunk_bytes=1e9),
                                dict(alignment=True), dict(alignment=64.0), dict(memory_budget=math.inf),
                                dict(block_size="x"), dict(reference_min_share=math.nan), dict(selective=math.inf),
                                dict(storage_write_bps=math.inf), dict(quantize=[1]), dict(quantize=None),
                                dict(metadata=[1]), dict(incremental_base=5), dict(allow_pickle="y")])
def test_save_options_checked_on_construction(kw):
    with pytest.raises(OptionsError, match=f"SaveOptions.{next(iter(kw))}"):
        SaveOptions(**kw)


def test_good_options_still_accepted():
    SaveOptions(timeout=1, chunk_bytes=1 << 20, quantize=["a*"], selective=0.1, memory_budget=1 << 20)
    LoadOptions(timeout=0.5, max_read_bytes=4096, share_reads=None)


@pytest.mark.parametrize("bad", [{"timeout": 5}, "x", 3, LoadOptions()])
def test_options_of_the_wrong_kind_refused_at_the_entry(tmp_path, small, bad):
    state = {"a": torch.zeros(4), "b": torch.zeros(4, 4), "c": torch.zeros(3)}
    calls = [lambda: liferaft.save(str(tmp_path / "o"), state, options=bad),
             lambda: liferaft.async_save(str(tmp_path / "o"), state, options=bad),
             lambda: liferaft.convert(small, str(tmp_path / "o.safetensors"), "safetensors", options=bad)]
    if not isinstance(bad, LoadOptions):
        calls += [lambda: liferaft.load(small, state, options=bad), lambda: liferaft.read(small, options=bad),
                  lambda: liferaft.diff(small, small, options=bad)]
    for call in calls:
        with pytest.raises(OptionsError, match="options= must be a liferaft"):
            call()
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad", [b"/tmp/x", 3, None, "", 1.5, "a\x00b"])
def test_paths_that_are_not_paths_refused_at_the_entry(tmp_path, small, bad):
    state = {"t": torch.zeros(2)}
    calls = [lambda: liferaft.save(bad, state), lambda: liferaft.async_save(bad, state),
             lambda: liferaft.load(bad, state), lambda: liferaft.read(bad), lambda: liferaft.inspect(bad),
             lambda: liferaft.verify(bad), lambda: liferaft.describe(bad), lambda: liferaft.format_of(bad),
             lambda: liferaft.diff(bad, small), lambda: liferaft.diff(small, bad),
             lambda: liferaft.convert(bad, str(tmp_path / "c"), "safetensors"),
             lambda: liferaft.convert(small, bad, "safetensors"), lambda: liferaft.ls(bad),
             lambda: liferaft.gc(bad, keep_last=1), lambda: liferaft.CheckpointManager(bad)]
    for call in calls:
        with pytest.raises(OptionsError):
            call()


def test_diff_of_infinities_tolerance_and_nan(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    liferaft.save(a, {"x": torch.tensor([math.inf, 1.0, math.nan]), "y": torch.tensor([math.nan, 2.0])})
    liferaft.save(b, {"x": torch.tensor([-math.inf, 1.0, math.nan]), "y": torch.tensor([1.0, 2.0])})
    r = {k.key: k for k in liferaft.diff(a, b).keys}
    assert r["x"].status == "changed" and r["x"].max_abs == math.inf and r["x"].max_rel == math.inf
    assert r["y"].status == "changed" and r["y"].max_abs == math.inf      # NaN vs a number: no tolerance hides it
    assert liferaft.diff(a, b, tolerance=1e300).changed()
    for tol in (-1, math.nan, math.inf, "1", True):
        with pytest.raises(OptionsError, match="tolerance"):
            liferaft.diff(a, b, tolerance=tol)


# --------------------------------------------------------------------------------------------------- the CLI

def _cli(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return status, out, err


@pytest.mark.parametrize("argv", [["plan", "--gpus", "abc"], ["plan", "--gpus", "-5"], ["plan", "--gpus", ","],
                                  ["plan", "--node-share", "nan"], ["plan", "--node-share", "2"],
                                  ["plan", "--failures-per-gpu-hour", "-1"], ["plan", "--failures-per-gpu-hour", "inf"],
                                  ["gc", "/nonexistent", "--keep-last", "x"], ["gc", "/nonexistent", "--keep-last", "-1"],
                                  ["diff", "a", "b", "--tolerance", "nan"], ["diff", "a", "b", "--tolerance", "-1"],
                                  ["convert", "a", "b", "--to", "dcp", "--max-shard-size", "0"]])
def test_cli_bad_numbers_are_usage_errors(capsys, argv):
    status, _, err = _cli(capsys, *argv)
    assert status == 2 and "error:" in err


COSTS = {
    "missing": None, "not_json": "{nope", "deep": "[" * 5000 + "]" * 5000, "nan": '{"stall": NaN}',
    "list": "[1, 2]", "incomplete": json.dumps({"stall": {"memory": 1}, "restore": {"memory": 1, "peer": 1, "remote": 1}}),
    "wrong_type": json.dumps({"stall": {"memory": "1", "remote": 1}, "restore": {"memory": 1, "peer": 1, "remote": 1}}),
    "negative": json.dumps({"stall": {"memory": 1, "remote": 1}, "restore": {"memory": 1, "peer": 1, "remote": -1}}),
    "bool": json.dumps({"stall": {"memory": 1, "remote": 1}, "restore": {"memory": 1, "peer": 1, "remote": 1},
                        "restart": True}),
    "unknown": json.dumps({"stall": {"memory": 1, "remote": 1}, "restore": {"memory": 1, "peer": 1, "remote": 1},
                           "stal": 1}),
    "section_not_object": json.dumps({"stall": 3, "restore": {"memory": 1, "peer": 1, "remote": 1}}),
    "huge": json.dumps({"stall": {"memory": 1e308, "remote": 1}, "restore": {"memory": 1, "peer": 1, "remote": 1}}),
    "not_utf8": b"\xff\xfe{",
}
NAMED = {"incomplete": "stall.remote", "wrong_type": "stall.memory", "negative": "restore.remote",
         "bool": "restart", "unknown": "stal", "section_not_object": "stall", "huge": "stall.memory"}


@pytest.mark.parametrize("case", sorted(COSTS))
def test_cli_plan_costs_file_errors_are_one_line(tmp_path, capsys, case):
    path = tmp_path / "costs.json"
    if COSTS[case] is not None:
        path.write_bytes(COSTS[case] if isinstance(COSTS[case], bytes) else COSTS[case].encode())
    status, _, err = _cli(capsys, "plan", "--costs", str(path))
    assert status == 1 and len(err.strip().splitlines()) == 1 and str(path) in err
    assert NAMED.get(case, "") in err


def test_cli_plan_costs_file_that_is_a_fifo_or_folder(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name in ("fifo", "dir"):
        status, _, err = _cli(capsys, "plan", "--costs", str(tmp_path / name))
        assert status == 1 and len(err.strip().splitlines()) == 1


def test_cli_plan_good_costs_file(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"stall": {"memory": 0.1, "remote": 1}, "restore": {"memory": 1, "peer": 2, "remote": 30},
                                "persist": {"remote": 10}, "restart": 60}))
    status, out, _ = _cli(capsys, "plan", "--costs", str(path), "--gpus", "1000")
    assert status == 0 and "99.8%" in out and "costs (s):" in out


@pytest.mark.parametrize("command", ["convert", "diff"])
@pytest.mark.parametrize("pair", [("(", "x"), ("a", r"\9"), ("[", "")])
def test_cli_bad_rename_is_a_usage_error_naming_it(tmp_path, small, capsys, command, pair):
    argv = [command, small, str(tmp_path / "out"), "--rename", *pair] + (["--to", "safetensors"] if command == "convert"
                                                                       else [])
    if command == "diff":
        argv[2] = small
    status, _, err = _cli(capsys, *argv)
    # (a usage error, docs/API.md: exit status 2, argparse's usage, then one error line naming the pair)
    assert status == 2 and "--rename" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "out").exists()
    with pytest.raises(OptionsError, match="rename"):
        liferaft.convert(small, str(tmp_path / "out"), "safetensors", rename=[pair])


def test_cli_ls_verify_lists_every_step_and_fails_on_a_bad_one(tmp_path, capsys):
    root = tmp_path / "root"
    with liferaft.CheckpointManager(str(root), every_steps=1, async_save=False) as m:
        for step in (1, 2, 3):
            m.save(step, {"t": torch.full((4,), float(step))})
    step2 = next(p for p in root.iterdir() if p.name.endswith("2"))
    (step2 / "COMMIT").unlink()
    (step2 / "COMMIT").mkdir()                                   # a COMMIT that is a folder
    step3 = next(p for p in root.iterdir() if p.name.endswith("3"))
    manifest = next(step3.glob("manifest*"))
    manifest.write_bytes(b"{broken")
    status, out, err = _cli(capsys, "ls", "--verify", str(root))
    assert status == 1, err
    rows = [ln.split() for ln in out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "2", "3"] and rows[0][1] == "committed"
    assert rows[1][1] != "committed" and rows[2][1] != "committed"
    status, out, _ = _cli(capsys, "ls", "--verify", "--json", str(root))
    assert status == 1 and [s["status"] == "committed" for s in json.loads(out)] == [True, False, False]


def test_cli_read_of_a_deep_tree_is_no_traceback(tmp_path, capsys):
    value = 1
    for _ in range(MAX_NESTING - 2):
        value = {"k": value}
    path = str(tmp_path / "deep")
    liferaft.save(path, {"t": torch.zeros(1), "v": value})
    status, out, _ = _cli(capsys, "read", path)
    assert status == 0 and "v" in out


# ------------------------------------------------------------------------------------ output linear in keys

N_KEYS = 40_000          # (100,000 took 66–100 s of the suite on the 2-core machine, a third of it the fixture's two
#                           saves; the quadratic steps this caught cost minutes at 100k and 40k² = 1.6e9 steps still
#                           costs tens of seconds here, which the suite's durations show; at 100k keys, under cProfile
#                           on 2026-12-06: `liferaft inspect` 13 s, `read --json` 21 s, `diff --json` 32 s)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """Two checkpoints of N_KEYS small tensors differing in one key."""
    root = tmp_path_factory.mktemp("many")
    a, b = str(root / "a"), str(root / "b")
    state = {"m": {f"k{i}": torch.zeros(2) for i in range(N_KEYS)}}
    liferaft.save(a, state)
    state["m"]["k5"] = torch.ones(2)
    liferaft.save(b, state)
    return a, b


def test_cli_commands_over_many_keys(many, capsys):
    """inspect (the tree), read --json and diff finish over N_KEYS keys: each of them was quadratic (the tree's
    sibling lists, a read job per key in diff) and took minutes at 100,000; the suite's durations show a
    regression."""
    a, b = many
    status, out, _ = _cli(capsys, "inspect", a)
    assert status == 0 and out.count(" float32 ") == N_KEYS and f"{N_KEYS} key(s)" in out
    status, out, _ = _cli(capsys, "read", "--json", a)
    assert status == 0 and len(json.loads(out)) == N_KEYS
    status, out, _ = _cli(capsys, "diff", "--json", a, b)
    report = json.loads(out)
    assert status == 1 and len(report["keys"]) == N_KEYS
    assert [k["key"] for k in report["keys"] if k["status"] != "equal"] == ["m.k5"]


def test_api_errors_are_liferaft_errors():
    assert issubclass(OptionsError, LiferaftError) and issubclass(InvalidStateError, LiferaftError)


@pytest.mark.parametrize("keep", [0, 4096])
@pytest.mark.parametrize("mode", ["sync", "async overlapped", "async blocking"])
def test_a_tensor_whose_storage_was_shrunk_is_refused_by_name_before_any_byte_is_read_or_written(tmp_path, keep,
                                                                                                 mode):
    """A tensor whose storage was resized or freed behind its back (FSDP frees parameters so) still claims its shape:
    a save refuses it naming the key (helper-126: a save crashed, or committed heap bytes that verified), and a load
    into one refuses it before any byte of the state is written."""
    w = torch.arange(1 << 15, dtype=torch.float32)
    ok = torch.arange(100, dtype=torch.float32)
    shrunk = torch.arange(1 << 15, dtype=torch.float32)
    shrunk.untyped_storage().resize_(keep)
    path = str(tmp_path / "ck")
    with pytest.raises(InvalidStateError, match=r"key 'shrunk'.*storage holds"):
        if mode == "sync":
            liferaft.save(path, {"w": w, "shrunk": shrunk})
        else:
            liferaft.async_save(path, {"w": w, "shrunk": shrunk},
                                options=SaveOptions(staging=mode.split()[1])).wait()
    assert not os.path.exists(os.path.join(path, "COMMIT"))
    liferaft.save(path, {"w": w, "ok": ok})
    target = {"w": torch.zeros(1 << 15), "ok": torch.zeros(100)}
    target["ok"].untyped_storage().resize_(keep // 32)             # (0 or 128 of its 400 bytes)
    with pytest.raises(InvalidStateError, match=r"key 'ok'.*storage holds"):
        liferaft.load(path, target)
    assert not target["w"].any()                    # (nothing loaded)


class _FreesLater:
    """A stateful object whose ``state_dict()`` (called late in the walk) frees a tensor walked before it."""

    def __init__(self, victim: torch.Tensor, keep: int) -> None:
        self.victim, self.keep = victim, keep

    def state_dict(self):
        self.victim.untyped_storage().resize_(self.keep)
        return {}

    def load_state_dict(self, sd):
        pass


@pytest.mark.parametrize("keep", [0, 2, 4096])
def test_a_storage_freed_by_a_state_dict_later_in_the_walk_is_still_refused_by_name(tmp_path, keep):
    """The storage check runs after the whole state is walked (helper-127: a ``state_dict()`` called after a
    tensor was checked freed it; a save of a transposed tensor committed heap bytes that verified, a load into a
    0-d tensor wrote past its storage)."""
    base = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512)
    with pytest.raises(InvalidStateError, match=r"key 'a'.*storage holds"):
        liferaft.save(str(tmp_path / "s"), {"a": base.t(), "z": _FreesLater(base, keep)})
    assert not os.path.exists(tmp_path / "s" / "COMMIT")
    liferaft.save(str(tmp_path / "l"), {"a": torch.tensor(3.0), "b": torch.arange(10.0)})
    zero_d, other = torch.tensor(0.0), torch.zeros(10)
    with pytest.raises(InvalidStateError, match=r"key 'a'.*storage holds"):
        liferaft.load(str(tmp_path / "l"), {"a": zero_d, "b": other, "z": _FreesLater(zero_d, min(keep, 2))})
    assert not other.any()


@pytest.mark.parametrize("staging", ["sync", "blocking", "overlapped"])
def test_one_element_views_whose_stride_is_not_one_save_and_load(tmp_path, staging):
    """``t[2:3, 1]`` is contiguous for torch with stride 4 (helper-127: its bytes could not be viewed, every save
    raised)."""
    grid = torch.arange(16.0).reshape(4, 4)
    state = {"col": grid[2:3, 1], "cell": grid[1:2, 1:2], "c": torch.randn(4, 2, dtype=torch.complex64)[1:2, 1]}
    path = str(tmp_path / "ck")
    if staging == "sync":
        liferaft.save(path, state)
    else:
        liferaft.async_save(path, state, options=SaveOptions(staging=staging)).wait()
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    liferaft.load(path, back)
    assert all(torch.equal(back[k], v) for k, v in state.items())
