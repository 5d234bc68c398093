"""liferaft's own on-disk parsers under hostile input (issue #16, classes 2 and 3): the strict JSON reader, the
manifest and commit marker (depth, NaN/Infinity, integer ranges, container kinds, times, enums), codec frames
(malformed headers, declared sizes beyond the chunk: refused before allocating) and a manager root's LEASE / PINS /
STARTS. Each mutation is written into a real checkpoint (re-sealing COMMIT: ``liferaft.testing.tamper``) and goes
through the public API and the CLI: a LiferaftError, a one-line CLI error, exit 1."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import liferaft
from liferaft.cli import main
from liferaft.errors import CorruptCheckpointError, LiferaftError
from liferaft.format.jsonsafe import json_depth, loads
from liferaft.format.limits import MAX_JSON_DEPTH
from liferaft.testing import tamper


def _state() -> dict:
    return {"model": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(5, dtype=torch.int64)},
            "meta": {"step": 7, "lr": 0.5, "names": ["a", "b"], "layers": [torch.ones(1), torch.ones(2)],
                     "pair": (torch.zeros(1), 3)}}


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ck")
    liferaft.save(path, _state())
    return path


def _refused_everywhere(path: str, capsys, match: str | None = None) -> None:
    """Every reading API call and CLI command refuses ``path`` with a LiferaftError (CLI: one line, exit 1)."""
    calls = [lambda: liferaft.load(path, _state()), lambda: liferaft.read(path), lambda: liferaft.inspect(path),
             lambda: liferaft.verify(path), lambda: liferaft.diff(path, path),
             lambda: liferaft.convert(path, path + ".st", to="safetensors")]
    for call in calls:
        with pytest.raises(LiferaftError, match=match):
            call()
    capsys.readouterr()
    for cmd in (["inspect", path], ["verify", path], ["read", path]):
        assert main(cmd) == 1, cmd
        err = capsys.readouterr().err.strip()
        assert err and "\n" not in err and "Traceback" not in err, (cmd, err)


# ------------------------------------------------------------------------------------------- the JSON reader


@pytest.mark.parametrize("data", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                  b"[" * 200_000])
def test_deep_json_is_refused_before_parsing(data):
    with pytest.raises(CorruptCheckpointError, match="nested .* deep"):
        loads(data, "f.json", 1 << 30)


def test_depth_scan_ignores_brackets_in_strings_and_escapes():
    assert json_depth(b'["]]]", "[[[", "\\"[", {"a": ["\\\\"]}]') == 3
    assert json_depth(b'"' + b'[' * 1000 + b'"') == 0
    doc = json.dumps({"k": "[" * (MAX_JSON_DEPTH + 5)}).encode()
    assert loads(doc, "f", 1 << 20) == {"k": "[" * (MAX_JSON_DEPTH + 5)}


@pytest.mark.parametrize("data, what", [
    (b"[NaN]", "NaN"), (b'{"t": Infinity}', "Infinity"), (b"[-Infinity]", "Infinity"), (b"[1e400]", "overflows"),
    (b'{"a": 1, "a": 2}', "twice"), (b"\xff\xfe[]", "UTF-8"), ("[]".encode("utf-16"), "UTF-8"),
    (b"1" * 5000, "digits"), (b"[1, 2", "not valid JSON"), (b"", "not valid JSON"), (b"[] []", "not valid JSON")])
def test_strict_json_refuses(data, what):
    with pytest.raises(CorruptCheckpointError, match=what) as e:
        loads(data, "dir/f.json", 1 << 20)
    assert "dir/f.json" in str(e.value)


def test_size_cap_is_checked_first():
    with pytest.raises(CorruptCheckpointError, match="more than the 10"):
        loads(b"[" * 11, "f", 10)


# ------------------------------------------------------------------------------- manifests and commit markers


@pytest.mark.parametrize("data", [
    b'{"format":"liferaft","version":3,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"format":"liferaft","version":3,"created_unix":NaN}',
    b'{"format":"liferaft","version":3,"format":"liferaft"}',
    b"\x80not json"])
def test_hostile_manifest_bytes(ckpt, capsys, data):
    tamper.write_manifest_bytes(ckpt, data)
    _refused_everywhere(ckpt, capsys)


@pytest.mark.parametrize("edit", [
    lambda m: m.update(manifest_size=float("nan")), lambda m: m.update(manifest_size=2 ** 64),
    lambda m: m.update(manifest_size=True), lambda m: m.update(manifest_size=-1), lambda m: [m],
    lambda m: m.update(version=1.5)])
def test_hostile_commit_marker(ckpt, capsys, edit):
    tamper.rewrite_marker(ckpt, edit)
    _refused_everywhere(ckpt, capsys)


def test_deep_commit_marker(ckpt, capsys):
    with open(os.path.join(ckpt, "COMMIT"), "wb") as f:
        f.write(b"[" * 100_000)
    _refused_everywhere(ckpt, capsys)


# ------------------------------------------------------------------------------- a manager root's own files


@pytest.fixture
def root(tmp_path):
    r = str(tmp_path / "root")
    with liferaft.CheckpointManager(r, async_save=False, preemption=liferaft.PreemptionOptions(signals=())) as m:
        m.save(1, _state())
        m.pin(1)
    return r


BAD_ROOT_FILES = [b"[" * 100_000, b"[NaN]", b"[Infinity]", b"\xff", b'{"a":', b"[1.5]", b"[true]", b"[-1]",
                  b"[18446744073709551616]", b'["1"]', b"{}", b"[[1]]"]


@pytest.mark.parametrize("data", BAD_ROOT_FILES)
def test_hostile_pins(root, capsys, data):
    with open(os.path.join(root, "PINS"), "wb") as f:
        f.write(data)
    with pytest.raises(CorruptCheckpointError, match="PINS.*delete it"):
        liferaft.gc(root, keep_last=1)
    assert [s.step for s in liferaft.ls(root)] == [1]                # ls still lists (no pins shown)
    capsys.readouterr()
    assert main(["gc", root, "--keep-last", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "PINS" in err and "\n" not in err
    assert main(["ls", root]) == 1                                    # listed, then PINS reported (review B)
    out = capsys.readouterr()
    assert "PINS" in out.err and "\n" not in out.err.strip() and " 1 " in out.out


@pytest.mark.parametrize("data", BAD_ROOT_FILES + [b'{"job_id":"x","host":"h","pid":1e400,"renewed_unix":1}',
                                                   b'{"job_id":"x","host":"h","pid":5,"renewed_unix":NaN}',
                                                   b'{"job_id":"x","host":"h","pid":true,"renewed_unix":1}'])
def test_hostile_lease_and_starts_are_treated_as_absent(root, data):
    for name in ("LEASE", "STARTS"):
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
    with liferaft.CheckpointManager(root, async_save=False, preemption=liferaft.PreemptionOptions(signals=()),
                                    save_policy=liferaft.SavePolicy(every_seconds="auto")) as m:
        m.save(2, _state())
    starts = json.loads(open(os.path.join(root, "STARTS")).read()) if os.path.exists(
        os.path.join(root, "STARTS")) else []
    assert all(isinstance(x, float) for x in starts)


# --------------------------------------------------------------------------- manifest fields, every one checked


def _tensor(doc: dict, key: str = "model.w") -> dict:
    return next(t for t in doc["tensors"] if t["key"] == key)


def _set_chunk(field, value):
    def edit(doc):
        _tensor(doc)["chunks"][0][field] = value
    return edit


def _set_tensor(field, value):
    def edit(doc):
        _tensor(doc)[field] = value
    return edit


def _set_top(field, value):
    def edit(doc):
        doc[field] = value
    return edit


HOSTILE_NUMBERS = [2 ** 64, 2 ** 63, -1, 1.5, True, None, "3", [1]]


@pytest.mark.parametrize("bad", HOSTILE_NUMBERS)
@pytest.mark.parametrize("field", ["byte_offset", "length", "block_size"])
def test_chunk_integers_are_range_checked(ckpt, capsys, field, bad):
    tamper.rewrite_manifest(ckpt, _set_chunk(field, bad))
    _refused_everywhere(ckpt, capsys)


@pytest.mark.parametrize("bad", [[2 ** 64, 4], [-1, 4], [1.5, 4], [True, 4], [3], [3, 4, 1], "34"])
@pytest.mark.parametrize("field", ["offsets", "sizes"])
def test_chunk_boxes_are_range_checked(ckpt, capsys, field, bad):
    tamper.rewrite_manifest(ckpt, _set_chunk(field, bad))
    _refused_everywhere(ckpt, capsys)


@pytest.mark.parametrize("bad", [[2 ** 64, 4], [-1, 4], [3.0, 4], [True, 4], [2 ** 40, 2 ** 40], [1] * 1000, 12])
def test_shapes_are_range_checked(ckpt, capsys, bad):
    tamper.rewrite_manifest(ckpt, _set_tensor("shape", bad))
    _refused_everywhere(ckpt, capsys)


@pytest.mark.parametrize("edit", [
    _set_tensor("dtype", "float128"), _set_tensor("dtype", 5), _set_tensor("kind", "sparse"),
    _set_chunk("codec", "lz4-future"), _set_chunk("file", "../../etc/passwd"), _set_chunk("hashes", [1]),
    _set_top("world_size", 0), _set_top("world_size", 2 ** 63), _set_top("world_size", 1.0),
    _set_top("created_unix", 1e300), _set_top("created_unix", -5), _set_top("created_unix", True),
    _set_top("created_unix", "yesterday"), _set_top("version", 99.0), _set_top("tensors", {"a": 1}),
    _set_top("files", []), lambda d: d["files"].update({k: 2 ** 64 for k in d["files"]}),
    lambda d: d["files"].update({k: -1 for k in d["files"]}), _set_tensor("lossy", {"method": "q8", "max": 1e400})])
def test_enums_files_and_times(ckpt, capsys, edit):
    try:
        tamper.rewrite_manifest(ckpt, edit)
    except OverflowError:          # (1e400 is not writable as JSON: write it by hand)
        pytest.skip("not writable")
    _refused_everywhere(ckpt, capsys)


def test_nan_and_huge_times_written_by_hand(ckpt, capsys):
    for t in (b"NaN", b"Infinity", b"1e300", b"1e999"):
        doc, _ = tamper.read_manifest(ckpt)
        doc["created_unix"] = 12345.5
        data = json.dumps(doc).encode().replace(b"12345.5", t)
        tamper.write_manifest_bytes(ckpt, data)
        _refused_everywhere(ckpt, capsys)


def _containers(doc, path):
    return next(c for c in doc["containers"] if c["path"] == path)


@pytest.mark.parametrize("edit", [
    lambda d: _containers(d, ["meta", "layers"]).update(kind="tuple", children=[0, 5]),     # a hole listed
    lambda d: _tensor(d, "meta.layers.1").update(path=["meta", "layers", 5]),                # a hole
    lambda d: _containers(d, ["meta"]).update(kind="list"),                                 # dict-keyed children
    lambda d: _containers(d, ["meta", "pair"]).update(kind="dict", children=[0]),           # child not listed
    lambda d: _containers(d, ["meta", "layers"]).update(children=["x", "y"]),
    lambda d: _containers(d, ["meta", "layers"]).update(children=[0, 0]),
    lambda d: _containers(d, ["meta", "layers"]).update(kind="bag"),
    lambda d: _containers(d, ["meta", "layers"]).update(role=5),
    lambda d: d["containers"].append(dict(_containers(d, ["meta"]))),                       # recorded twice
    lambda d: d["values"].append({"key": "meta.step.x", "path": ["meta", "step", "x"], "value": 1}),  # under a leaf
    lambda d: d["values"].append({"key": "dup", "path": ["meta", "step"], "value": 1}),     # path used twice
    lambda d: next(v for v in d["values"] if v["key"] == "meta.pair.1").update(path=["meta", "pair", 7]),
    lambda d: next(v for v in d["values"] if v["key"] == "meta.pair.1").update(path=["meta", "pair", True]),
    lambda d: next(v for v in d["values"] if v["key"] == "meta.pair.1").update(path=["x"] * 1000),
    lambda d: next(v for v in d["values"] if v["key"] == "meta.pair.1").update(path=["meta", "pair", 2 ** 64]),
])
def test_containers_whose_children_do_not_match_their_kind(ckpt, capsys, edit):
    tamper.rewrite_manifest(ckpt, edit)
    _refused_everywhere(ckpt, capsys)


@pytest.mark.parametrize("value", [
    {"$tuple": []}, [], {"a": 1}, {"$dict": []}, {"$set": []}])
def test_plain_values_nested_too_deep(ckpt, capsys, value):
    def nest(d):
        deep = 1
        for _ in range(150):
            deep = json.loads(json.dumps(value).replace("[]", json.dumps([deep]), 1)) if "[]" in json.dumps(
                value) else {"a": deep}
        next(v for v in d["values"] if v["key"] == "meta.step")["value"] = deep
    tamper.rewrite_manifest(ckpt, nest)
    _refused_everywhere(ckpt, capsys, match="levels deep")


def test_values_at_the_nesting_limit_are_read(tmp_path):
    from liferaft.format.limits import MAX_NESTING

    deep: object = 1
    for _ in range(MAX_NESTING):
        deep = [deep]
    path = str(tmp_path / "ok")
    liferaft.save(path, {"v": deep})
    assert liferaft.read(path)["v"] == deep


# ------------------------------------------------------------------------------------------------ codec frames


@pytest.fixture
def encoded(tmp_path):
    """A checkpoint whose ``q`` is stored as q8 frames and ``z`` as bytegroup-zstd frames (one block each)."""
    path = str(tmp_path / "enc")
    state = {"q": torch.linspace(-1, 1, 4096), "z": torch.zeros(4096, dtype=torch.float64)}
    liferaft.save(path, state, options=liferaft.SaveOptions(compression="on", quantize=("q",)))
    doc, _ = tamper.read_manifest(path)
    assert {t["key"]: t["chunks"][0].get("codec") for t in doc["tensors"]} == {"q": "q8-block",
                                                                                "z": "bytegroup-zstd"}
    return path


def _frame(path: str, key: str) -> tuple[str, int, int]:
    doc, _ = tamper.read_manifest(path)
    c = _tensor(doc, key)["chunks"][0]
    return os.path.join(path, c["file"]), c["byte_offset"], c["frames"][0]


def _patch(file: str, offset: int, data: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _load_refused(path: str, capsys, key: str) -> None:
    for call in (lambda: liferaft.read(path), lambda: liferaft.verify(path),
                 lambda: liferaft.load(path, {"q": torch.zeros(4096), "z": torch.zeros(4096, dtype=torch.float64)})):
        with pytest.raises(LiferaftError):
            call()
    capsys.readouterr()
    assert main(["read", path]) == 1 and main(["verify", path]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and key in err


HUGE = [struct.pack("<4sBBII", b"LRQ8", 1, 1, 16, 2 ** 31), struct.pack("<4sBBII", b"LRQ8", 1, 1, 16, 2 ** 32 - 1),
        struct.pack("<4sBBII", b"LRQ8", 1, 1, 2 ** 32 - 1, 256), struct.pack("<4sBBII", b"LRQ8", 1, 1, 16, 0),
        struct.pack("<4sBBII", b"LRQ8", 9, 1, 16, 256), struct.pack("<4sBBII", b"LRQ8", 1, 3, 4096, 256),
        b"XXXX"]


@pytest.mark.parametrize("header", HUGE)
def test_q8_frames_declaring_more_are_refused_before_allocating(encoded, capsys, header):
    file, offset, length = _frame(encoded, "q")
    _patch(file, offset, header)
    _load_refused(encoded, capsys, "q")


def test_a_54_byte_q8_frame_with_a_huge_group_allocates_nothing(tmp_path):
    from liferaft.codecs.quantize import Q8Block

    frame = struct.pack("<4sBBII", b"LRQ8", 1, 1, 36, 2 ** 31) + b"\0" * 4 + b"\1" * 36
    assert len(frame) == 54
    for out in (bytearray(144), bytearray(4 * 2 ** 31 // 1024)):
        with pytest.raises(CorruptCheckpointError, match="groups of"):
            Q8Block().decode_block(memoryview(frame), memoryview(out), "float32", "k")


@pytest.mark.parametrize("header", [
    struct.pack("<4sBBQ", b"LRBG", 1, 8, 2 ** 50), struct.pack("<4sBBQ", b"LRBG", 1, 8, 2 ** 64 - 1),
    struct.pack("<4sBBQ", b"LRBG", 1, 0, 32768), struct.pack("<4sBBQ", b"LRBG", 1, 200, 32768),
    struct.pack("<4sBBQ", b"LRBG", 7, 8, 32768), b"LRX", b"\0" * 14])
def test_bytegroup_frames_declaring_more_are_refused(encoded, capsys, header):
    file, offset, length = _frame(encoded, "z")
    _patch(file, offset, header)
    _load_refused(encoded, capsys, "z")


def test_bytegroup_plane_sizes_beyond_the_frame(encoded, capsys):
    file, offset, length = _frame(encoded, "z")
    for k in range(9):                  # each plane's declared size, in turn, far beyond the frame
        _patch(file, offset + 14 + 9 * k + 1, struct.pack("<Q", 2 ** 50))
        _load_refused(encoded, capsys, "z")


def test_bytegroup_without_out_is_capped():
    from liferaft.codecs import bytegroup

    frame = bytegroup.encode(b"\0" * 4096, 8)
    assert bytegroup.decode(frame) == b"\0" * 4096
    with pytest.raises(CorruptCheckpointError, match="more than the 1024"):
        bytegroup.decode(frame, max_size=1024)


def test_truncated_frames(encoded, capsys):
    for key in ("q", "z"):
        file, offset, length = _frame(encoded, key)
        for cut in (3, 9, length - 1):
            def edit(doc, cut=cut, key=key):
                c = _tensor(doc, key)["chunks"][0]
                c["frames"] = [cut]
            tamper.rewrite_manifest(encoded, edit)
            _load_refused(encoded, capsys, key)


@pytest.mark.parametrize("key", ["q", "z"])
def test_a_manifest_claiming_huge_decoded_blocks_for_small_frames_is_refused_at_open(encoded, capsys, key):
    def edit(doc):
        t = _tensor(doc, key)
        t["shape"] = [2 ** 40]
        c = t["chunks"][0]
        c.update(sizes=[2 ** 40], length=2 ** 40 * (8 if key == "z" else 4), block_size=2 ** 40 * 8)
    tamper.rewrite_manifest(encoded, edit)
    _refused_everywhere(encoded, capsys, match="cannot hold a block")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "uint8"])
def test_every_codec_keeps_within_its_max_expansion(dtype):
    from liferaft.codecs.registry import CODECS

    for codec in CODECS:
        if codec.max_expansion is None or not codec.accepts(dtype):
            continue
        for size in (16, 4096, 1 << 20, 4 << 20, 64 << 20):
            block = memoryview(bytearray(size))              # zeros: the densest a real block compresses
            frame = codec.encode_block(block, dtype)
            assert size <= len(frame) * codec.max_expansion, (codec.name, dtype, size, len(frame))


def test_strings_with_escaped_surrogates_still_round_trip(tmp_path):
    # a data loader's file name decoded with surrogateescape: strict JSON must not refuse what liferaft writes
    path = str(tmp_path / "s")
    state = {"files": ["caf\udce9.txt", "\U0001f600"], "t": torch.ones(1)}
    liferaft.save(path, state)
    assert liferaft.read(path)["files"] == state["files"]


_CLAIMS_RUN = """
import resource, sys, torch, liferaft
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
p = sys.argv[1]
for name, call in [("read", lambda: liferaft.read(p)), ("verify", lambda: liferaft.verify(p)),
                   ("diff", lambda: liferaft.diff(p, p)), ("convert", lambda: liferaft.convert(p, p + ".st", to="safetensors")),
                   ("load", lambda: liferaft.load(p, {"model": {"w": torch.empty(0)}}, strict=False))]:
    try:
        call()
        print(name, "returned")
    except liferaft.LiferaftError as e:
        print(name, "refused")
    except BaseException as e:
        print(name, "RAW", type(e).__name__, e)
"""


def test_file_sizes_the_manifest_claims_are_checked_before_allocating(ckpt):
    import subprocess
    import sys

    def edit(doc):
        t = _tensor(doc)
        t["shape"] = [2 ** 60, 1]
        c = t["chunks"][0]
        c.update(sizes=[2 ** 60, 1], length=2 ** 62, block_size=2 ** 62, hashes=["0" * 16])
        doc["files"][c["file"]] = 2 ** 62
    tamper.rewrite_manifest(ckpt, edit)
    r = subprocess.run([sys.executable, "-c", _CLAIMS_RUN, ckpt], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    lines = r.stdout.split("\n")
    assert [ln for ln in lines if ln.endswith("refused")] == [f"{n} refused" for n in ("read", "verify", "diff",
                                                                                       "convert", "load")], r
