"""Hostile foreign checkpoints (issue #16, class 4): safetensors headers, torch.save archives and DCP folders made by
the formats' own writers, then mutated bytewise and structurally. Each one ends in one LiferaftError naming the file
through every entry point — load, read, inspect, verify, diff, convert to each format, and the CLI (one line on
stderr, exit 1) — and never in a successful read of wrong bytes. The expansion bomb runs in a subprocess under
memory, file-size and time limits, so that a regression fails instead of eating the machine."""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import liferaft
from liferaft.cli import main
from liferaft.testing import foreign_files as ff

pytest.importorskip("safetensors.torch")


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def refused_everywhere(path: str, tmp_path, capsys, match: str, good: str | None = None, *,
                       inspect: bool = True) -> None:
    """``path`` is refused with a LiferaftError matching ``match`` by every API call and CLI command (``inspect``
    False: but by inspect, which reads a DCP folder's metadata only, not its blobs)."""
    template = {k: torch.zeros_like(v) for k, v in ff.sample_state().items()}
    calls = {"inspect": lambda: liferaft.inspect(path), "read": lambda: liferaft.read(path),
             "verify": lambda: liferaft.verify(path), "load": lambda: liferaft.load(path, template)}
    if good is not None:
        calls["diff"] = lambda: liferaft.diff(path, good)
    for to in ("liferaft", "safetensors", "torch", "dcp"):
        dst = str(tmp_path / f"out-{to}{'.pt' if to == 'torch' else ''}")
        calls[f"convert-{to}"] = lambda dst=dst, to=to: liferaft.convert(path, dst, to)
    if not inspect:
        liferaft.inspect(path)
        del calls["inspect"]
    for name, call in calls.items():
        with pytest.raises(liferaft.LiferaftError, match=match):
            call()
            pytest.fail(f"{name} accepted {path}")
    assert all(torch.count_nonzero(t) == 0 for t in template.values())      # nothing written before the refusal
    commands = [["verify", path], ["read", path], ["convert", path, str(tmp_path / "cli-out"), "--to", "liferaft"]]
    for args in commands + ([["inspect", path]] if inspect else []):
        assert main(args) == 1, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], (args, err)


# --------------------------------------------------------------------------- safetensors

def _last(h):
    return max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def _shift_last(by: int):
    def edit(h):
        h[_last(h)]["data_offsets"] = [x + by for x in h[_last(h)]["data_offsets"]]
    return edit


def _onto_a(h):
    """Place "b" over "a"'s first bytes (or "a" over "b"'s when "b" starts the data)."""
    moved, under = ("b", "a") if h["b"]["data_offsets"][0] != 0 else ("a", "b")
    n = h[moved]["data_offsets"][1] - h[moved]["data_offsets"][0]
    at = h[under]["data_offsets"][0] + 4
    h[moved]["data_offsets"] = [at, at + n]


def _set(key: str, field: str, value):
    def edit(h):
        h[key][field] = value
    return edit


ST_EDITS = {
    "overlap": (_onto_a, None, "overlap"),
    "negative": (_set("c", "data_offsets", [-4, 0]), None, "data_offsets"),
    "hole": (_shift_last(4), "extra", "no tensor covers"),
    "trailing": (None, "extra", "cover"),
    "past_end": (_shift_last(64), None, "truncated"),
    "size_mismatch": (_set("a", "shape", [3, 3]), None, "takes"),
    "entry_not_object": (lambda h: h.__setitem__("a", [1, 2]), None, "not an object"),
    "overflow_shape": (_set("a", "shape", [2**63, 2**63]), None, "absurdly large"),
    "float_offsets": (_set("a", "data_offsets", [0.0, 24.0]), None, "two integers"),
    "big_ints": (_set("a", "data_offsets", [0, 10**30]), None, "data_offsets"),
}


@pytest.mark.parametrize("case", [*ST_EDITS, "not_json", "not_object", "length_2_62", "longer_than_file"])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_a_crafted_safetensors_header_is_refused_everywhere(tmp_path, capsys, case, layout):
    good = ff.safetensors_file(tmp_path / "good.safetensors")
    if layout == "file":
        path = target = ff.safetensors_file(tmp_path / "bad.safetensors")
    else:
        path = ff.safetensors_folder(tmp_path / "bad", shards=1)
        target = os.path.join(path, "model-00001-of-00001.safetensors")
    if case in ST_EDITS:
        edit, extra, match = ST_EDITS[case]
        _, data = ff.read_safetensors_header(target)
        ff.rewrite_safetensors_header(target, edit, data=data + b"\0" * 4 if extra else None)
    elif case == "not_json":
        ff.rewrite_safetensors_header(target, raw=b"{not json"); match = "header"
    elif case == "not_object":
        ff.rewrite_safetensors_header(target, raw=b"[1, 2]"); match = "not a JSON object"
    else:
        blob = open(target, "rb").read()
        n = 2**62 if case == "length_2_62" else len(blob)
        open(target, "wb").write(struct.pack("<Q", n) + blob[8:]); match = "header is said to take"
    refused_everywhere(path, tmp_path, capsys, match, good)


def test_a_header_that_moves_a_tensor_onto_anothers_bytes_never_loads(tmp_path):
    """The worst outcome (issue #16): every in-bounds placement of "b" other than its own is refused."""
    path = ff.safetensors_file(tmp_path / "m.safetensors")
    header, data = ff.read_safetensors_header(path)
    begin, end = header["b"]["data_offsets"]
    for at in range(0, len(data) - (end - begin) + 1, 2):
        if at == begin:
            continue
        ff.rewrite_safetensors_header(path, lambda h, at=at: h["b"].__setitem__("data_offsets", [at, at + end - begin]))
        with pytest.raises(liferaft.CorruptCheckpointError, match="m.safetensors"):
            liferaft.read(path)
    ff.rewrite_safetensors_header(path, lambda h: h["b"].__setitem__("data_offsets", [begin, end]))
    assert torch.equal(liferaft.read(path)["b"], ff.sample_state()["b"])


# --------------------------------------------------------------------------- torch.save

def _records(edit):
    def make(p):
        ff.torch_file(p)
        ff.rewrite_zip_members(p, edit)
    return make


def _past_storage(m):
    """A (2, 3) view over a storage that holds 1 element (the pickle's numel and the record both shrunk)."""
    pkl = next(k for k in m if k.endswith("data.pkl"))
    m[pkl] = m[pkl].replace(b"X\x03\x00\x00\x00cpuq\x06K\x06", b"X\x03\x00\x00\x00cpuq\x06K\x01")
    m[next(k for k in m if k.endswith("/data/0"))] = b"\0" * 4


def _zip_edit(edit):
    """A torch.save file of ``{"w": ones(1024)}`` rewritten by ``edit(path, zipfile of it)``."""
    def make(p):
        torch.save({"w": torch.ones(1024)}, p)
        with zipfile.ZipFile(p) as z:
            edit(p, z)
    return make


def _deflated(p, z):
    """Every data record deflated: a valid zip that torch.load (no mmap) reads; a map would see compressed bytes."""
    members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(p, "w") as out:
        for name, blob in members:
            out.writestr(name, blob, zipfile.ZIP_DEFLATED if "/data/" in name else zipfile.ZIP_STORED)


def _oversized(p, z):
    """A record of 16 bytes whose directory entries declare 4096 (CRC of the 16): a map would read past it."""
    members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(p, "w") as out:
        for name, blob in members:
            out.writestr(name, blob[:16] if name.endswith("/data/0") else blob)
            if name.endswith("/data/0"):
                out.writestr(name[:-1] + "pad", bytes(range(256)) * 32)
    raw = bytearray(open(p, "rb").read())
    with zipfile.ZipFile(p) as zz:
        info = next(i for i in zz.infolist() if i.filename.endswith("/data/0"))
        struct.pack_into("<I", raw, info.header_offset + 22, 4096)
    at = raw.find(b"PK\x01\x02")
    while at != -1:
        n = struct.unpack_from("<H", raw, at + 28)[0]
        if bytes(raw[at + 46:at + 46 + n]).endswith(b"/data/0"):
            struct.pack_into("<I", raw, at + 24, 4096)
        at = raw.find(b"PK\x01\x02", at + 4)
    open(p, "wb").write(raw)


def _short(m):
    k = next(k for k in m if k.endswith("/data/0"))
    m[k] = m[k][:4]


TORCH_CASES = {
    "pickle": (lambda p: torch.save({"a": Evil()}, p), "weights_only"),
    "legacy_pickle": (lambda p: torch.save({"a": Evil()}, p, _use_new_zipfile_serialization=False), "weights_only"),
    "raw_pickle": (lambda p: pickle.dump({"a": 1}, open(p, "wb")), "not a torch.save file"),
    "missing_record": (_records(lambda m: [m.pop(k) for k in list(m) if k.endswith("/data/0")]), "no record"),
    "short_record": (_records(_short), "its record holds"),
    "no_pickle": (_records(lambda m: [m.pop(k) for k in list(m) if k.endswith("data.pkl")]), "torch.save"),
    "view_past_storage": (_records(_past_storage), "'a'.*needs 24 bytes"),
    "expansion_bomb": (lambda p: ff.torch_file(p, {"a": torch.ones(1).expand(2**40)}), "'a'.*once copied"),
    "legacy_expansion_bomb": (lambda p: torch.save({"a": torch.ones(1).expand(2**40)}, p,
                                                   _use_new_zipfile_serialization=False), "'a'.*once copied"),
    "shared_storage_bomb": (lambda p: ff.torch_file(p, {f"k{i}": t for t in [torch.zeros(1 << 20)]
                                                       for i in range(100)}), "once copied"),
    "deflated_record": (_zip_edit(_deflated), "data/0' is compressed"),
    "record_size_beyond_its_data": (_zip_edit(_oversized), "data/0' declares 4096 bytes but stores 16"),
    "sparse_coo": (lambda p: ff.torch_file(p, {"a": torch.eye(3).to_sparse()}), "'a'.*sparse"),
    "sparse_csr": (lambda p: ff.torch_file(p, {"a": torch.eye(3).to_sparse_csr()}), "'a'.*sparse_csr"),
    "sparse_bsr": (lambda p: ff.torch_file(p, {"a": torch.eye(4).to_sparse_bsr((2, 2))}), "'a'.*sparse_bsr"),
    "nested": (lambda p: ff.torch_file(p, {"a": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}),
               "nested"),
    "quantized": (lambda p: ff.torch_file(p, {"a": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)}),
                  "quantized"),
    "meta": (lambda p: ff.torch_file(p, {"a": torch.empty(4, device="meta")}), "'a'.*meta"),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", [*TORCH_CASES, "truncated_early", "truncated_late", "flipped_directory"])
def test_a_hostile_torch_file_is_refused_everywhere(tmp_path, capsys, case):
    path = str(tmp_path / "bad.pt")
    if case in TORCH_CASES:
        make, match = TORCH_CASES[case]
        make(path)
    else:
        blob = open(ff.torch_file(path), "rb").read()
        blob = {"truncated_early": blob[:len(blob) // 3], "truncated_late": blob[:-30],
                "flipped_directory": blob[:-40] + bytes(b ^ 0xFF for b in blob[-40:-30]) + blob[-30:]}[case]
        open(path, "wb").write(blob)
        match = "bad.pt"
    refused_everywhere(path, tmp_path, capsys, match, ff.torch_file(tmp_path / "good.pt"))


def test_broadcast_buffers_that_fit_their_storage_still_load(tmp_path):
    """Hugging Face's ``position_ids = arange(n).expand(1, -1)`` (stride 0 only on a size-1 dimension) and tied
    weights (two keys, one storage) are ordinary files."""
    w = torch.randn(4, 3)
    path = ff.torch_file(tmp_path / "m.pt", {"position_ids": torch.arange(8).expand(1, -1), "emb": w, "head": w,
                                              "q": w[:2], "k": w[2:]})
    got = liferaft.read(path)
    assert torch.equal(got["position_ids"], torch.arange(8)[None]) and torch.equal(got["head"], w)
    assert torch.equal(got["k"], w[2:])
    liferaft.verify(path)
    liferaft.convert(path, str(tmp_path / "st"), "safetensors")
    assert torch.equal(liferaft.read(str(tmp_path / "st"))["position_ids"], torch.arange(8)[None])


BROADCASTS = {"zeros(1).expand(10)": lambda: torch.zeros(1).expand(10),
              "arange(8).expand(4, 8)": lambda: torch.arange(8).expand(4, 8),
              "arange(4.).expand(3, 1, 4)": lambda: torch.arange(4.).expand(3, 1, 4),
              "tensor(1.).expand(2, 3)": lambda: torch.tensor(1.).expand(2, 3),
              "column expand": lambda: torch.arange(3.)[:, None].expand(3, 5),
              "expanded slice": lambda: torch.arange(10.)[4:6].expand(3, 2)}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("legacy", [False, True])
def test_small_broadcast_buffers_read_exactly_and_convert(tmp_path, legacy):
    """A view whose extent (offset + Σ (size − 1) × stride + 1 elements) fits its storage reads, however many
    elements it shows, while the file's copied bytes stay within the budget; the values survive convert."""
    want = {k.replace(" ", "_"): make() for k, make in BROADCASTS.items()}
    path = str(tmp_path / "b.pt")
    torch.save(want, path, _use_new_zipfile_serialization=not legacy)
    got = liferaft.read(path)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    liferaft.verify(path)
    for to in ("safetensors", "liferaft"):
        liferaft.convert(path, str(tmp_path / to), to)
        back = liferaft.read(str(tmp_path / to))
        assert all(torch.equal(back[k], v.contiguous()) for k, v in want.items()), to


BOMB = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, 256 << 20))
import torch, liferaft
from liferaft.cli import main
path, out = sys.argv[1], sys.argv[2]
torch.save({"a": torch.ones(1).expand(2**40)}, path)
for call in (lambda: liferaft.read(path), lambda: liferaft.inspect(path), lambda: liferaft.verify(path),
             *[lambda to=to: liferaft.convert(path, out + to + (".pt" if to == "torch" else ""), to)
               for to in ("liferaft", "safetensors", "torch", "dcp")]):
    try:
        call()
        print("ACCEPTED")
    except liferaft.CorruptCheckpointError as e:
        assert "'a'" in str(e), e
        print("refused")
assert main(["read", path]) == 1 and main(["convert", path, out + "cli", "--to", "torch"]) == 1
"""


def test_an_expansion_bomb_is_refused_before_allocating_or_writing(tmp_path):
    """``torch.ones(1).expand(2**40)`` saves as a 1.5 KB file; reading it allocated 4 TiB and convert wrote until the
    disk was full. Run under a 3 GiB address space, 256 MiB files and a time limit."""
    r = subprocess.run([sys.executable, "-c", BOMB, str(tmp_path / "bomb.pt"), str(tmp_path / "out-")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["refused"] * 7, r.stdout


# --------------------------------------------------------------------------- DCP

def _rename(meta, key, new):
    """Key ``key`` renamed ``new`` in the metadata and its storage entries."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta.state_dict_metadata[new] = meta.state_dict_metadata.pop(key)
    meta.storage_data = {MetadataIndex(new, ix.offset, ix.index) if ix.fqn == key else ix: info
                         for ix, info in meta.storage_data.items()}


def _storage(meta, key):
    return next(info for ix, info in meta.storage_data.items() if ix.fqn == key)


def _dcp_edit(fn):
    def make(d):
        ff.dcp_folder(d)
        ff.rewrite_dcp_metadata(d, fn)
    return make


def _overlap(meta):
    a, b = _storage(meta, "a"), _storage(meta, "b")
    if a.relative_path == b.relative_path:
        object.__setattr__(b, "offset", a.offset + 8)
    else:
        object.__setattr__(b, "relative_path", a.relative_path)
        object.__setattr__(b, "offset", a.offset)


def _blob_swap(tensor):
    """A folder whose blob for "a" is replaced (appended to its shard, metadata pointed at it) by ``tensor``."""
    import io

    def make(d):
        ff.dcp_folder(d)
        buf = io.BytesIO()
        torch.save(tensor, buf)

        def edit(meta):
            info = _storage(meta, "a")
            file = os.path.join(d, info.relative_path)
            at = os.path.getsize(file)
            with open(file, "ab") as f:
                f.write(buf.getvalue())
            object.__setattr__(info, "offset", at)
            object.__setattr__(info, "length", len(buf.getvalue()))
        ff.rewrite_dcp_metadata(d, edit)
    return make


def _blob_deflated(d):
    """The blob of "a" re-zipped with its data record deflated (torch.load of the blob still reads it)."""
    import io

    ff.dcp_folder(d)

    def edit(meta):
        info = _storage(meta, "a")
        file = os.path.join(d, info.relative_path)
        with open(file, "rb") as f:
            f.seek(info.offset)
            src = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            for i in src.infolist():
                z.writestr(i.filename, src.read(i), zipfile.ZIP_DEFLATED if "/data/" in i.filename else 0)
        at = os.path.getsize(file)
        with open(file, "ab") as f:
            f.write(out.getvalue())
        object.__setattr__(info, "offset", at)
        object.__setattr__(info, "length", len(out.getvalue()))
    ff.rewrite_dcp_metadata(d, edit)


def _claims(n: int):
    """Tensor "a" (2 x 3 float32, one chunk) claimed to hold ``n`` x 3 elements: its blob holds 24 bytes of them."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def edit(meta):
        md = meta.state_dict_metadata["a"]
        md.size = torch.Size([n, 3])
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([n, 3]))]
    return _dcp_edit(edit)


def _long_path(meta):
    """planner_data giving "a" a path of 5,000 parts (the cost of nesting it grew with the square of its length)."""
    meta.planner_data = {**(meta.planner_data or {}), "a": tuple(["x"] * 5000)}


DCP_CASES = {
    "claims_1_tib": (_claims(2**38 // 3), "more than its .*-byte blob holds"),
    "claims_more_than_stored": (_claims(1000), "more than its .*-byte blob holds"),
    "long_path": (_dcp_edit(_long_path), "5000 parts"),
    "long_dotted_key": (_dcp_edit(lambda m: setattr(m, "planner_data", None) or _rename(m, "a", ".".join(["a"] * 5000))),
                        "5000 parts"),
    "overlapping_blobs": (_dcp_edit(_overlap), "overlapping bytes|overlap"),
    "past_end": (_dcp_edit(lambda m: object.__setattr__(_storage(m, "a"), "length", 10**9)), "truncated"),
    "negative_length": (_dcp_edit(lambda m: object.__setattr__(_storage(m, "a"), "length", -1)), "non-negative"),
    "beyond_int64": (_dcp_edit(lambda m: object.__setattr__(_storage(m, "a"), "offset", 2**70)), "non-negative"),
    "float_length": (_dcp_edit(lambda m: object.__setattr__(_storage(m, "a"), "length", 12.0)), "non-negative"),
    "expanded_blob": (_blob_swap(torch.ones(1).expand(2**40)), "'a'.*once copied"),
    "deflated_blob": (_blob_deflated, "data/0' is compressed"),
    "sparse_blob": (_blob_swap(torch.eye(2, 3).to_sparse()), "'a'"),
    "pickle_blob": (_blob_swap(Evil()), "weights_only"),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", DCP_CASES)
def test_a_hostile_dcp_folder_is_refused_everywhere(tmp_path, capsys, case):
    path = str(tmp_path / "bad")
    make, match = DCP_CASES[case]
    make(path)
    refused_everywhere(path, tmp_path, capsys, match, ff.dcp_folder(tmp_path / "good"),
                       inspect=not case.endswith("_blob"))


@pytest.mark.filterwarnings("ignore")
def test_the_builders_write_what_liferaft_reads_back(tmp_path):
    want = ff.sample_state()
    for path in (ff.safetensors_file(tmp_path / "m.safetensors"), ff.safetensors_folder(tmp_path / "hf"),
                 ff.torch_file(tmp_path / "m.pt"), ff.dcp_folder(tmp_path / "dcp")):
        got = liferaft.read(path)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), path
        liferaft.verify(path)
    ff.rewrite_zip_members(tmp_path / "m.pt", lambda m: None)     # a rewrite that changes nothing reads the same
    assert torch.equal(liferaft.read(str(tmp_path / "m.pt"))["a"], want["a"])


@pytest.mark.parametrize("claims", [{"y": ("x",)}, {"z": ("x", "sub")}, {"y": ("x",), "z": ("x", "sub")}])
def test_dcp_planner_paths_that_collide_are_refused_not_merged(tmp_path, claims):
    # planner_data sending two keys to one path, or one under another key's leaf: read kept one tensor (with
    # another's values) and convert wrote one of three, while inspect listed three (found by fuzzing)
    from liferaft.testing.foreign_files import dcp_folder, rewrite_dcp_metadata

    d = str(tmp_path / "dcp")
    dcp_folder(d, {"x": torch.zeros(3), "y": torch.ones(3), "z": torch.full((2,), 7.0)})

    def edit(m):
        m.planner_data.update(claims)
    rewrite_dcp_metadata(d, edit)
    with pytest.raises(liferaft.CorruptCheckpointError, match="'x'"):
        liferaft.read(d)
    with pytest.raises(liferaft.CorruptCheckpointError, match="'x'"):
        liferaft.convert(d, str(tmp_path / "out"), "liferaft")
    assert not os.path.exists(tmp_path / "out" / "COMMIT")


def test_a_tree_with_an_entry_under_a_value_is_refused():
    from liferaft.state.tree import build_tree, nest

    with pytest.raises(liferaft.CorruptCheckpointError, match="lies under it"):
        nest({("x",): 1, ("x", "sub"): 2})
    with pytest.raises(liferaft.CorruptCheckpointError, match="a container too"):
        build_tree({("x",): "dict"}, {("x",): 1})


@pytest.mark.parametrize("chunks", [7, 1.5, "x", {"a": 1}, None])
def test_a_manifest_whose_chunks_are_not_a_list_is_refused(tmp_path, chunks):
    from liferaft.testing import tamper

    p = str(tmp_path / "ck")
    liferaft.save(p, {"w": torch.ones(3)})

    def edit(doc):
        doc["tensors"][0]["chunks"] = chunks
    tamper.rewrite_manifest(p, edit)
    with pytest.raises(liferaft.CorruptCheckpointError, match="'w'"):
        liferaft.inspect(p)


def _members(p):
    with zipfile.ZipFile(p) as z:
        return {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}


@pytest.mark.parametrize("evil_state", ["past", "bomb"])
def test_a_decoy_pickle_beside_the_one_torch_reads_is_not_what_is_checked(tmp_path, evil_state):
    # the check took the first record ending in data.pkl ("b/xdata.pkl": prefix "b/x") while torch.load reads
    # "b/data.pkl": a harmless decoy passed and torch mapped 256 bytes over a 16-byte record, or allocated 8 GiB
    # (found by fuzzing); now the prefix is the first record's folder, as torch takes it
    good = _members(ff.torch_file(str(tmp_path / "good.pt"), {"w": torch.arange(4.0)}))
    if evil_state == "bomb":
        evil = _members(ff.torch_file(str(tmp_path / "evil.pt"), {"w": torch.ones(1).expand(2 ** 31)}))
    else:
        evil = _members(ff.torch_file(str(tmp_path / "evil.pt"), {"w": torch.arange(64.0)}))
        evil["data/0"] = good["data/0"]
    p = str(tmp_path / "mix.pt")
    ff.torch_file(p)

    def edit(m):
        m.clear()
        m["b/xdata.pkl"], m["b/xdata/0"] = good["data.pkl"], good["data/0"]
        for k, v in evil.items():
            m["b/" + k] = v
    ff.rewrite_zip_members(p, edit)
    with pytest.raises(liferaft.LiferaftError):
        liferaft.read(p)


def _zip_of(items, comment_pad=0):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for k, (name, blob) in enumerate(items):
            info = zipfile.ZipInfo("archive/" + name)
            pad = (-(buf.tell() + 30 + len(info.filename.encode()) + 4)) % 64
            info.extra = struct.pack("<HH", 0xCAFE, pad) + b"\0" * pad
            if k == 0:
                info.comment = b"c" * comment_pad
            z.writestr(info, blob)
    raw = buf.getvalue()
    eocd = raw.rindex(b"PK\x05\x06")
    n, _, off_cd = struct.unpack("<HII", raw[eocd + 10:eocd + 20])
    return raw[:off_cd], raw[off_cd:eocd], n


def test_a_zip_with_two_central_directories_is_refused(tmp_path):
    # Python's zipfile (the checks) honours a "concat" offset and reads one central directory, torch's reader the
    # other at the end record's raw offset: the checks saw a decoy, torch.load mapped 256 bytes over 16 (fuzzing)
    def members(obj):
        b = io.BytesIO()
        torch.save(obj, b)
        with zipfile.ZipFile(b) as z:
            return [(i.filename.split("/", 1)[1], z.read(i)) for i in z.infolist()]
    decoy = members({"w": torch.arange(4.0)}) + [("zpad", b"")]
    evil = [(n, b if n != "data/0" else b"\x01" * 16) for n, b in members({"w": torch.arange(64.0)})]
    evil.append(("zpad", b"\0" * 4096))
    le, ce, ne = _zip_of(evil)
    ld, cd, nd = _zip_of(decoy)
    assert ne == nd
    if len(ce) < len(cd):
        le, ce, _ = _zip_of(evil, len(cd) - len(ce))
    elif len(cd) < len(ce):
        ld, cd, _ = _zip_of(decoy, len(ce) - len(cd))
    s = len(le) + len(ce)
    concat = s + len(ld) - len(le)
    cdb, pos = bytearray(cd), 0
    while pos < len(cdb):
        n_, m_, k_ = struct.unpack("<HHH", cdb[pos + 28:pos + 34])
        (o,) = struct.unpack("<I", cdb[pos + 42:pos + 46])
        cdb[pos + 42:pos + 46] = struct.pack("<I", s + o - concat)
        pos += 46 + n_ + m_ + k_
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, ne, ne, len(ce), len(le), 0)
    p = tmp_path / "poly.pt"
    p.write_bytes(le + ce + ld + bytes(cdb) + end)
    with zipfile.ZipFile(p) as z:
        assert z.namelist()[0] == "archive/data.pkl"             # (what the checks read: the decoy)
    with pytest.raises(liferaft.CorruptCheckpointError, match="two readings"):
        liferaft.read(str(p))
    assert main(["verify", str(p)]) != 0
