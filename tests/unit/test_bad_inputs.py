"""Every bad input the spec lists: the specific LiferaftError subclass, a message naming the key or file, and
nothing changed — the state passed to a failed load keeps its values, and a committed checkpoint at the path
of a failed save still loads with its old values and passes ``liferaft.verify``.

Damaged checkpoints are made by editing the stored files through the storage backend (so every case runs on
the file and the memory backend); a manifest edit re-writes the COMMIT marker's size and hash, so that only
the check under test can catch it.
"""

from __future__ import annotations

import copy
import errno
import json
import threading

import pytest
import torch
import xxhash

import liferaft
from liferaft import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    InvalidStateError,
    LiferaftError,
    LoadOptions,
    PickleNotAllowedError,
    SaveOptions,
    Sharded,
    StateMismatchError,
    StorageError,
    UnsafePathError,
)
from liferaft.storage import MemoryStorage, PosixStorage, register_scheme, resolve

# ----------------------------------------------------------------------------------------------- helpers


def make_state(scale: int = 1) -> dict:
    return {"enc": {"weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale,
                    "bias": torch.tensor([7, 8, 9, 10], dtype=torch.int64) * scale},
            "step": 42 * scale, "name": f"run-{scale}"}


def template() -> dict:
    """Same keys, shapes and dtypes as make_state(), other values."""
    return {"enc": {"weight": torch.full((2, 3), -1.0), "bias": torch.full((4,), -1, dtype=torch.int64)},
            "step": -1, "name": "old"}


from compare import assert_same


def assert_load_fails(path, state, exc, *needles, strict=True, options=None):
    """load raises ``exc`` whose message holds every needle, and ``state`` is left exactly as it was."""
    before = copy.deepcopy(state)
    with pytest.raises(exc) as info:
        liferaft.load(path, state, strict=strict, options=options)
    for n in needles:
        assert n in str(info.value), f"{n!r} not in message: {info.value}"
    assert_same(state, before)
    return info.value


def assert_old_intact(path, old: dict) -> None:
    t = template()
    liferaft.load(path, t)
    assert_same(t, old)
    liferaft.verify(path)


def marker_doc(path) -> dict:
    return json.loads(resolve(path).read_all("COMMIT"))


def write_marker(path, doc: dict) -> None:
    resolve(path).put_atomic("COMMIT", json.dumps(doc).encode())


def edit_manifest(path, fn) -> str:
    """Apply ``fn`` to the manifest JSON, store it and re-pin it in the marker; return the manifest name."""
    st, mk = resolve(path), marker_doc(path)
    doc = json.loads(st.read_all(mk["manifest"]))
    fn(doc)
    data = json.dumps(doc).encode()
    st.put_atomic(mk["manifest"], data)
    mk["manifest_size"], mk["manifest_hash"] = len(data), xxhash.xxh3_64_hexdigest(data)
    write_marker(path, mk)
    return mk["manifest"]


def tensor_doc(doc: dict, key: str) -> dict:
    return next(t for t in doc["tensors"] if t["key"] == key)


def chunk_of(path, key: str) -> dict:
    st = resolve(path)
    doc = json.loads(st.read_all(marker_doc(path)["manifest"]))
    (chunk,) = tensor_doc(doc, key)["chunks"]
    return chunk


def rewrite_file(path, name: str, fn) -> None:
    st = resolve(path)
    st.put_atomic(name, bytes(fn(bytearray(st.read_all(name)))))


def every_reader_raises(path, exc, *needles, readers=("read", "inspect", "verify")) -> None:
    for name in readers:
        with pytest.raises(exc) as info:
            getattr(liferaft, name)(path)
        for n in needles:
            assert n in str(info.value), f"liferaft.{name}: {n!r} not in message: {info.value}"


@pytest.fixture
def saved(backend_path):
    """A committed checkpoint of make_state() at backend_path."""
    liferaft.save(backend_path, make_state())
    return backend_path


class Custom:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return type(other) is Custom and other.x == self.x


# ------------------------------------------------------------------------------ the helpers edit correctly


def test_no_op_manifest_edit_keeps_checkpoint_loadable(saved):
    edit_manifest(saved, lambda doc: None)
    assert_old_intact(saved, make_state())


def test_manifest_edit_without_marker_fix_is_caught(saved):
    st, name = resolve(saved), marker_doc(saved)["manifest"]
    st.put_atomic(name, st.read_all(name) + b" ")
    assert_load_fails(saved, template(), CorruptCheckpointError, name, saved)


# --------------------------------------------------------------------------------------- state mismatches


def test_missing_key_strict(saved):
    t = template()
    t["extra"] = torch.zeros(3)
    t["enc"]["extra_value"] = 5
    assert_load_fails(saved, t, StateMismatchError, "'extra'", "'enc.extra_value'", saved)


def test_unexpected_key_strict(saved):
    t = template()
    del t["enc"]["bias"], t["name"]
    assert_load_fails(saved, t, StateMismatchError, "'enc.bias'", "'name'", saved)


def test_non_strict_reports_both_and_loads_the_matching_keys(saved):
    t = template()
    del t["enc"]["bias"], t["name"]
    t["extra"] = torch.zeros(3)
    t["enc"]["extra_value"] = 5
    res = liferaft.load(saved, t, strict=False)
    assert set(res.missing_keys) == {"extra", "enc.extra_value"}
    assert set(res.unexpected_keys) == {"enc.bias", "name"}
    ref = make_state()
    assert_same(t["enc"]["weight"], ref["enc"]["weight"])
    assert t["step"] == ref["step"]
    assert_same(t["extra"], torch.zeros(3))
    assert t["enc"]["extra_value"] == 5


MISMATCHES = {
    "shape": ("enc.weight", lambda t: t["enc"].__setitem__("weight", torch.zeros(3, 2))),
    "dtype": ("enc.weight", lambda t: t["enc"].__setitem__("weight", torch.zeros(2, 3, dtype=torch.float64))),
    "ndim": ("enc.bias", lambda t: t["enc"].__setitem__("bias", torch.zeros(2, 2, dtype=torch.int64))),
    "tensor_for_value": ("step", lambda t: t.__setitem__("step", torch.zeros(()))),
    "value_for_tensor": ("enc.bias", lambda t: t["enc"].__setitem__("bias", 0)),
    "sharded_global_shape": ("enc.weight", lambda t: t["enc"].__setitem__(
        "weight", Sharded(torch.zeros(2, 3), (4, 3), (0, 0)))),
}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_shape_dtype_kind_mismatch_always_raises(saved, case, strict):
    key, mutate = MISMATCHES[case]
    t = template()
    mutate(t)
    assert_load_fails(saved, t, StateMismatchError, repr(key), strict=strict)


# ------------------------------------------------------------------------------ damaged / foreign checkpoints


def _gap(doc):
    c = tensor_doc(doc, "enc.weight")["chunks"][0]
    c["sizes"], c["length"] = [1, 3], 12          # rows 1.. are no longer covered


def _overlap(doc):
    c = tensor_doc(doc, "enc.weight")["chunks"][0]
    tensor_doc(doc, "enc.weight")["chunks"].append(dict(c, offsets=[1, 0], sizes=[1, 3], byte_offset=c["byte_offset"] + 12,
                                                        length=12))


def _outside(doc):
    c = tensor_doc(doc, "enc.weight")["chunks"][0]
    tensor_doc(doc, "enc.weight")["chunks"].append(dict(c, offsets=[2, 0], sizes=[1, 3], length=12))


@pytest.mark.parametrize("edit,word", [(_gap, "cover"), (_overlap, "overlap"), (_outside, "outside")])
def test_manifest_chunks_not_tiling_the_global_shape(saved, edit, word):
    edit_manifest(saved, edit)
    assert_load_fails(saved, template(), CorruptCheckpointError, "'enc.weight'", word, saved)
    every_reader_raises(saved, CorruptCheckpointError, "'enc.weight'", word)


def test_incomplete_checkpoint_without_commit(saved):
    resolve(saved).delete("COMMIT")
    assert_load_fails(saved, template(), IncompleteCheckpointError, saved, "COMMIT")
    every_reader_raises(saved, IncompleteCheckpointError, saved, "COMMIT")


def test_nonexistent_path(backend_path):
    path = backend_path + "-nothing-here"
    try:
        assert_load_fails(path, template(), CheckpointNotFoundError, path)
        every_reader_raises(path, CheckpointNotFoundError, path)
    finally:
        if path.startswith("memory://"):
            from liferaft.storage.memory import drop_memory_store
            drop_memory_store(path[len("memory://"):])


def test_empty_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_load_fails(str(tmp_path / "empty"), template(), CheckpointNotFoundError, str(tmp_path / "empty"))


def flip_byte(path, key: str) -> dict:
    c = chunk_of(path, key)

    def flip(b):
        b[c["byte_offset"] + 1] ^= 0x40
        return b

    rewrite_file(path, c["file"], flip)
    return c


@pytest.mark.parametrize("key", ["enc.weight", "enc.bias"])
def test_flipped_byte_in_data_file(saved, key):
    c = flip_byte(saved, key)
    t = template()
    before = copy.deepcopy(t)
    with pytest.raises(CorruptCheckpointError) as info:
        liferaft.load(saved, t)
    assert repr(c["file"]) in str(info.value) and repr(key) in str(info.value), str(info.value)
    # without LoadOptions(atomic=True) tensors read before the bad block may be filled; the tensor whose bytes
    # are corrupt and every plain value are unchanged
    group, name = key.split(".")
    assert_same(t[group][name], before[group][name], key)
    assert (t["step"], t["name"]) == (before["step"], before["name"])
    every_reader_raises(saved, CorruptCheckpointError, repr(c["file"]), repr(key), readers=("read", "verify"))
    liferaft.inspect(saved)  # the manifest itself is fine


@pytest.mark.parametrize("key", ["enc.weight", "enc.bias"])
def test_flipped_byte_atomic_load_changes_nothing(saved, key):
    c = flip_byte(saved, key)
    assert_load_fails(saved, template(), CorruptCheckpointError, repr(c["file"]), repr(key),
                      options=LoadOptions(atomic=True))


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_truncated_or_missing_data_file(saved, how):
    c = chunk_of(saved, "enc.bias")   # the last chunk of the only data file
    if how == "truncate":
        rewrite_file(saved, c["file"], lambda b: b[:c["byte_offset"] + 3])
    else:
        resolve(saved).delete(c["file"])
    assert_load_fails(saved, template(), CorruptCheckpointError, repr(c["file"]))
    every_reader_raises(saved, CorruptCheckpointError, repr(c["file"]), readers=("read", "verify"))


def test_manifest_of_a_newer_format_version(saved):
    name = edit_manifest(saved, lambda doc: doc.__setitem__("version", 99))
    assert_load_fails(saved, template(), FormatVersionError, name, "99")
    every_reader_raises(saved, FormatVersionError, name, "99")


def test_commit_marker_of_a_newer_format_version(saved):
    write_marker(saved, dict(marker_doc(saved), version=99))
    assert_load_fails(saved, template(), FormatVersionError, "COMMIT", "99")
    every_reader_raises(saved, FormatVersionError, "COMMIT", "99")


def _chunk_file(name):
    def edit(doc):
        tensor_doc(doc, "enc.weight")["chunks"][0]["file"] = name
    return edit


def _listed_file(name):
    def edit(doc):
        c = tensor_doc(doc, "enc.weight")["chunks"][0]
        doc["files"][name] = doc["files"][c["file"]]
        c["file"] = name
    return edit


@pytest.mark.parametrize("bad", ["../evil.bin", "data/../../evil.bin", "/etc/passwd"])
@pytest.mark.parametrize("where", ["chunk", "files"])
def test_manifest_file_path_outside_the_checkpoint(saved, where, bad):
    edit_manifest(saved, (_chunk_file if where == "chunk" else _listed_file)(bad))
    assert_load_fails(saved, template(), UnsafePathError, repr(bad))
    every_reader_raises(saved, UnsafePathError, repr(bad))


@pytest.mark.parametrize("bad", ["../x.json", "/tmp/x.json", "a/../../x.json"])
def test_marker_manifest_path_outside_the_checkpoint(saved, bad):
    write_marker(saved, dict(marker_doc(saved), manifest=bad))
    assert_load_fails(saved, template(), UnsafePathError, repr(bad))
    every_reader_raises(saved, UnsafePathError, repr(bad))


DAMAGED = {
    "tensor_not_object": lambda d: d["tensors"].__setitem__(0, 5),
    "value_not_object": lambda d: d["values"].__setitem__(0, "x"),
    "container_not_object": lambda d: d["containers"].__setitem__(0, 3),
    "created_not_number": lambda d: d.__setitem__("created_unix", "yesterday"),
    "tensors_not_list": lambda d: d.__setitem__("tensors", 7),
    "chunk_hashes_not_list": lambda d: tensor_doc(d, "enc.weight")["chunks"][0].__setitem__("hashes", 3),
    "duplicate_key": lambda d: d["tensors"].append(dict(d["tensors"][0])),
    "other_checksum": lambda d: d.__setitem__("checksum", "md5"),
    "big_endian": lambda d: d.__setitem__("byte_order", "big"),
    "version_0": lambda d: d.__setitem__("version", 0),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_structurally_damaged_manifest_is_a_corrupt_checkpoint(saved, case):
    name = edit_manifest(saved, DAMAGED[case])
    assert_load_fails(saved, template(), CorruptCheckpointError, name)
    every_reader_raises(saved, CorruptCheckpointError, name)


# ------------------------------------------------------------------------------------------ bad save input


@pytest.mark.parametrize("args", [
    (torch.zeros(2, 3), (3, 3), (2, 0)),      # past the end in dim 0
    (torch.zeros(2, 3), (4, 3), (0, 1)),      # past the end in dim 1
    (torch.zeros(2, 3), (4, 3), (-1, 0)),     # negative offset
    (torch.zeros(2, 3), (4, 3, 1), (0, 0, 0)),  # wrong number of dims
    (torch.zeros(2, 3), (4, 3), (0,)),
    ([1.0, 2.0], (2,), (0,)),                 # not a tensor
])
def test_sharded_out_of_bounds(args):
    with pytest.raises(InvalidStateError, match="Sharded"):
        Sharded(*args)


def test_sharded_not_covering_the_global_tensor_on_save(saved):
    bad = {"enc": {"weight": Sharded(torch.ones(2, 3), (4, 3), (0, 0))}}
    with pytest.raises(InvalidStateError) as info:
        liferaft.save(saved, bad, options=SaveOptions(overwrite=True))
    assert "'enc.weight'" in str(info.value)
    assert_old_intact(saved, make_state())


def test_custom_object_needs_allow_pickle_on_save(backend_path):
    state = dict(make_state(), obj=Custom(3))
    with pytest.raises(PickleNotAllowedError) as info:
        liferaft.save(backend_path, state)
    assert "'obj'" in str(info.value) and "Custom" in str(info.value)
    with pytest.raises(CheckpointNotFoundError):
        liferaft.inspect(backend_path)


def test_custom_object_on_overwrite_keeps_old_checkpoint(saved):
    with pytest.raises(PickleNotAllowedError, match="'obj'"):
        liferaft.save(saved, dict(make_state(2), obj=Custom(3)), options=SaveOptions(overwrite=True))
    assert_old_intact(saved, make_state())


def test_unpicklable_object_even_with_allow_pickle(saved):
    state = dict(make_state(2), lock=threading.Lock())
    with pytest.raises(PickleNotAllowedError, match="'lock'"):
        liferaft.save(saved, state, options=SaveOptions(overwrite=True, allow_pickle=True))
    assert_old_intact(saved, make_state())


def test_pickled_value_needs_allow_pickle_on_load(backend_path):
    liferaft.save(backend_path, dict(make_state(), obj=Custom(3)), options=SaveOptions(allow_pickle=True))
    t = dict(template(), obj=None)
    assert_load_fails(backend_path, t, PickleNotAllowedError, "'obj'")
    with pytest.raises(PickleNotAllowedError, match="'obj'"):
        liferaft.read(backend_path)
    assert liferaft.read(backend_path, ["enc"])["enc"]["bias"].tolist() == [7, 8, 9, 10]  # no pickled value chosen
    assert "obj" in liferaft.inspect(backend_path).values                              # inspect unpickles nothing
    liferaft.load(backend_path, t, options=LoadOptions(allow_pickle=True))
    assert_same(t, dict(make_state(), obj=Custom(3)))
    assert liferaft.read(backend_path, options=LoadOptions(allow_pickle=True))["obj"] == Custom(3)


def test_save_into_a_committed_checkpoint(saved):
    old_id = liferaft.inspect(saved).save_id
    with pytest.raises(CheckpointExistsError) as info:
        liferaft.save(saved, make_state(2))
    assert saved in str(info.value) and "overwrite" in str(info.value)
    assert_old_intact(saved, make_state())
    new_id = liferaft.save(saved, make_state(2), options=SaveOptions(overwrite=True)).save_id
    assert_old_intact(saved, make_state(2))
    leftovers = [n for n in resolve(saved).list() if old_id in n]
    assert leftovers == [], f"files of the replaced checkpoint remain: {leftovers}"
    assert liferaft.inspect(saved).save_id == new_id


# ------------------------------------------------------------------ crashes in the middle of an overwrite


class _CrashOnCommit:
    """put_atomic of COMMIT fails: the new data files and manifest are written, the marker is not."""

    def put_atomic(self, name, data):
        if name == "COMMIT":
            raise OSError(errno.EIO, "injected failure writing COMMIT")
        super().put_atomic(name, data)


class _FirstDeleteFails:
    """The first delete fails (a transient error while removing the replaced checkpoint's files)."""

    def delete(self, name):
        if not getattr(self, "_failed_once", False):
            self._failed_once = True
            raise OSError(errno.EIO, f"injected failure deleting {name}")
        super().delete(name)


for _mixin, _tag in [(_CrashOnCommit, "commitcrash"), (_FirstDeleteFails, "deletefail")]:
    _posix = type(f"{_mixin.__name__}Posix", (_mixin, PosixStorage), {})
    _mem = type(f"{_mixin.__name__}Memory", (_mixin, MemoryStorage), {})
    register_scheme(f"lrtest-{_tag}-file", _posix)
    register_scheme(f"lrtest-{_tag}-mem", _mem)


def via(tag: str, path: str) -> str:
    """``path`` opened through the failing test backend ``tag`` (same bytes, same backend kind)."""
    if path.startswith("memory://"):
        return f"lrtest-{tag}-mem://{path[len('memory://'):]}"
    return f"lrtest-{tag}-file://{path}"


def test_crash_before_the_commit_marker_keeps_the_old_checkpoint(saved):
    old_id = liferaft.inspect(saved).save_id
    with pytest.raises((OSError, StorageError)):
        liferaft.save(via("commitcrash", saved), make_state(2), options=SaveOptions(overwrite=True))
    assert liferaft.inspect(saved).save_id == old_id
    assert_old_intact(saved, make_state())
    # a later overwrite succeeds and leaves only its own files
    new_id = liferaft.save(saved, make_state(3), options=SaveOptions(overwrite=True)).save_id
    assert_old_intact(saved, make_state(3))
    assert all(new_id in n for n in resolve(saved).list() if n != "COMMIT")


@pytest.mark.filterwarnings("ignore:.*removing files of the checkpoint it replaced")
def test_failure_removing_the_replaced_checkpoint_leaves_one_whole_checkpoint(saved):
    """After the marker names the new manifest the save has committed: whatever fails later must not
    destroy it. Either the old or the new checkpoint loads, whole, and verifies."""
    try:
        liferaft.save(via("deletefail", saved), make_state(2), options=SaveOptions(overwrite=True))
    except (OSError, LiferaftError):
        pass
    t = template()
    liferaft.load(saved, t)
    liferaft.verify(saved)
    try:
        assert_same(t, make_state(2))
    except AssertionError:
        assert_same(t, make_state())
