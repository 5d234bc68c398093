"""Checkpoints are untrusted input, on the file-system side (issue #16, classes 1, 2 and 5): a data file, ``data/``,
``COMMIT`` or the manifest that is a link (inside or outside), a FIFO, a device, a folder or a huge sparse file is
refused with a LiferaftError by every command — never read, never a hang; references only to data files of
committed siblings; writes never through a planted link. Real files, real links, real FIFOs; calls that could hang
run in a subprocess (the CLI) or a thread with a timeout, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft.codecs.checksum import digest
from liferaft.errors import LiferaftError, UnsafePathError
from liferaft.storage import PosixStorage
from liferaft.storage.files import create_exclusive, open_read, read_capped

# --------------------------------------------------------------------------- helpers


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI in a subprocess: a hang fails the test (TimeoutExpired) instead of hanging the suite."""
    return liferaft_cli(*args, timeout=timeout)


def one_error(r: subprocess.CompletedProcess) -> str:
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(err) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return err[0]


def bounded(fn: Callable[[], Any], timeout: float = 60) -> BaseException | None:
    """Run ``fn`` in a thread; the exception it raised (None if it returned). A hang fails the test."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box[0] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} hung (a FIFO or an endless file read?)"
    return box[0]


STATE = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}


def saved(path: str) -> str:
    liferaft.save(path, {k: v.clone() for k, v in STATE.items()})
    return path


def data_file(ck: str) -> str:
    (name,) = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ck, "data")) for f in fs]
    return name


def manifest_of(ck: str) -> str:
    return os.path.join(ck, json.loads(open(os.path.join(ck, "COMMIT")).read())["manifest"])


def api_calls(ck: str, tmp: str) -> dict[str, Callable[[], Any]]:
    """Every reading entry point of the API on checkpoint ``ck``."""
    other = saved(os.path.join(tmp, "other")) if not os.path.exists(os.path.join(tmp, "other")) \
        else os.path.join(tmp, "other")
    return {
        "load": lambda: liferaft.load(ck, {k: torch.zeros_like(v) for k, v in STATE.items()}),
        "read": lambda: liferaft.read(ck),
        "verify": lambda: liferaft.verify(ck),
        "diff": lambda: liferaft.diff(ck, other),
        **{f"convert-{fmt}": (lambda fmt=fmt: liferaft.convert(ck, os.path.join(tmp, f"out-{fmt}-{os.urandom(4).hex()}"),
                                                                  fmt))
           for fmt in ("safetensors", "torch", "dcp")},
    }


def all_refused(ck: str, tmp: str, *, inspect_too: bool = True, cli_too: bool = False) -> None:
    """Every API call (and with ``cli_too`` CLI command) reading ``ck`` raises a LiferaftError (one line, exit 1,
    for the CLI)."""
    calls = api_calls(ck, tmp)
    if inspect_too:
        calls["inspect"] = lambda: liferaft.inspect(ck)
    for name, call in calls.items():
        e = bounded(call)
        assert isinstance(e, LiferaftError), (name, e)
    commands = [("verify", ck), ("read", ck)] + ([("inspect", ck)] if inspect_too else []) if cli_too else []
    for args in commands:
        one_error(cli(*args))


# --------------------------------------------------------------------------- (1) links inside a checkpoint


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_data_file_that_is_a_link_is_refused_by_every_command(tmp_path, where):
    ck = saved(str(tmp_path / "ck"))
    f = data_file(ck)
    copy = str(tmp_path / "elsewhere.bin") if where == "outside" else os.path.join(ck, "copy.bin")
    shutil.copy(f, copy)                                   # the same bytes: only the link is wrong
    os.unlink(f)
    os.symlink(copy, f)
    all_refused(ck, str(tmp_path), inspect_too=False, cli_too=where == "outside")
    with pytest.raises(LiferaftError, match="link"):
        liferaft.verify(ck)                               # verify never says OK


def test_the_data_folder_that_is_a_link_is_refused(tmp_path):
    ck = saved(str(tmp_path / "ck"))
    shutil.move(os.path.join(ck, "data"), str(tmp_path / "data-elsewhere"))
    os.symlink(str(tmp_path / "data-elsewhere"), os.path.join(ck, "data"))
    all_refused(ck, str(tmp_path), inspect_too=False)


@pytest.mark.parametrize("target", ["/dev/zero", "/proc/self/status", "copy"])
def test_commit_or_manifest_that_is_a_link_is_refused(tmp_path, target):
    for which in ("COMMIT", "manifest"):
        ck = saved(str(tmp_path / f"ck-{which}"))
        f = os.path.join(ck, "COMMIT") if which == "COMMIT" else manifest_of(ck)
        if target == "copy":
            shutil.copy(f, str(tmp_path / f"copy-{which}"))
            target_path = str(tmp_path / f"copy-{which}")
        else:
            target_path = target
        os.unlink(f)
        os.symlink(target_path, f)
        all_refused(ck, str(tmp_path))


# --------------------------------------------------------------------------- (2) FIFOs, devices, folders, huge files


@pytest.mark.parametrize("which", ["COMMIT", "manifest", "data"])
def test_a_fifo_never_hangs_a_command(tmp_path, which):
    ck = saved(str(tmp_path / "ck"))
    f = {"COMMIT": os.path.join(ck, "COMMIT"), "manifest": manifest_of(ck), "data": data_file(ck)}[which]
    os.unlink(f)
    os.mkfifo(f)
    all_refused(ck, str(tmp_path), inspect_too=which != "data", cli_too=True)


def test_ls_verify_reports_a_step_with_a_linked_data_file_and_lists_the_others(tmp_path):
    from liferaft.format.layout import step_name

    root = tmp_path / "root"
    good, bad = saved(str(root / step_name(1))), saved(str(root / step_name(2)))
    f = data_file(bad)
    shutil.copy(f, str(tmp_path / "copy.bin"))
    os.unlink(f)
    os.symlink(str(tmp_path / "copy.bin"), f)
    steps = {s.step: s for s in liferaft.ls(str(root), verify=True)}
    assert steps[1].status == "committed" and steps[2].status == "corrupt" and "link" in steps[2].reason, steps
    assert good
    r = cli("ls", "--verify", str(root))
    assert "Traceback" not in r.stderr and "corrupt" in r.stdout, (r.stdout, r.stderr)


@pytest.mark.parametrize("which", ["COMMIT", "data"])
def test_a_folder_where_a_file_should_be_is_refused(tmp_path, which):
    ck = saved(str(tmp_path / "ck"))
    f = os.path.join(ck, "COMMIT") if which == "COMMIT" else data_file(ck)
    os.unlink(f)
    os.mkdir(f)
    all_refused(ck, str(tmp_path), inspect_too=which == "COMMIT")


@pytest.mark.parametrize("which", ["COMMIT", "manifest"])
def test_a_huge_sparse_commit_or_manifest_is_refused_without_reading_it(tmp_path, which):
    ck = saved(str(tmp_path / "ck"))
    f = os.path.join(ck, "COMMIT") if which == "COMMIT" else manifest_of(ck)
    os.truncate(f, 8 << 30)                                # 8 GiB, no blocks: a whole read would take minutes
    e = bounded(lambda: liferaft.inspect(ck))
    assert isinstance(e, LiferaftError) and "bytes" in str(e), e
    one_error(cli("inspect", ck))


def test_a_marker_claiming_a_huge_manifest_is_refused(tmp_path):
    ck = saved(str(tmp_path / "ck"))
    doc = json.loads(open(os.path.join(ck, "COMMIT")).read())
    doc["manifest_size"] = 1 << 40
    open(os.path.join(ck, "COMMIT"), "w").write(json.dumps(doc))
    with pytest.raises(LiferaftError, match="size"):
        liferaft.inspect(ck)


def test_loading_the_root_of_the_disk_does_not_walk_it(tmp_path):
    e = bounded(lambda: liferaft.inspect("/"), timeout=60)
    assert isinstance(e, LiferaftError), e


# --------------------------------------------------------------------------- references to sibling checkpoints


def rewrite(ck: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest of ``ck`` and make the marker match it again (a crafted, consistent checkpoint)."""
    path = manifest_of(ck)
    doc = json.loads(open(path).read())
    edit(doc)
    data = json.dumps(doc).encode()
    open(path, "wb").write(data)
    marker = json.loads(open(os.path.join(ck, "COMMIT")).read())
    marker.update(manifest_size=len(data), manifest_hash=digest(data))
    open(os.path.join(ck, "COMMIT"), "w").write(json.dumps(marker))


def point_at(ck: str, name: str) -> None:
    """Make every chunk of ``ck`` read from ``name`` (a ``../<folder>/<file>`` reference)."""
    def edit(doc: dict[str, Any]) -> None:
        size = max(doc["files"].values())
        doc["files"] = {name: size}
        for t in doc["tensors"]:
            for c in t["chunks"]:
                c["file"] = name
    rewrite(ck, edit)


@pytest.mark.parametrize("case", ["uncommitted", "commit-marker", "manifest", "not-listed", "committed-ok"])
def test_references_only_to_data_files_of_committed_siblings(tmp_path, case):
    ck = saved(str(tmp_path / "ck"))
    sib = saved(str(tmp_path / "sib"))
    rel = os.path.relpath(data_file(sib), sib)
    if case == "uncommitted":
        os.unlink(os.path.join(sib, "COMMIT"))
        name = f"../sib/{rel}"
    elif case == "commit-marker":
        name = "../sib/COMMIT"
    elif case == "manifest":
        name = f"../sib/{os.path.basename(manifest_of(sib))}"
    elif case == "not-listed":
        extra = os.path.join(os.path.dirname(data_file(sib)), "r00007.bin")
        shutil.copy(data_file(sib), extra)
        name = f"../sib/{os.path.relpath(extra, sib)}"
    else:
        name = f"../sib/{rel}"
    point_at(ck, name)
    if case == "committed-ok":
        out = liferaft.read(ck)                           # same bytes at the same offsets: a genuine reference
        assert all(torch.equal(out[k], v) for k, v in STATE.items())
        liferaft.verify(ck)
        return
    for call in api_calls(ck, str(tmp_path)).values():
        e = bounded(call)
        assert isinstance(e, UnsafePathError), e
    one_error(cli("verify", ck))


def test_a_sibling_that_is_a_link_is_not_a_committed_sibling(tmp_path):
    ck = saved(str(tmp_path / "ck"))
    real = saved(str(tmp_path / "elsewhere" / "sib"))
    os.symlink(real, str(tmp_path / "sib"))
    point_at(ck, f"../sib/{os.path.relpath(data_file(real), real)}")
    with pytest.raises(UnsafePathError):
        liferaft.read(ck)


# --------------------------------------------------------------------------- foreign folders


def test_a_dcp_shard_that_is_a_link_or_names_a_path_outside_is_refused(tmp_path):
    src = saved(str(tmp_path / "ck"))
    dcp = str(tmp_path / "dcp")
    liferaft.convert(src, dcp, "dcp")
    shard = os.path.join(dcp, "__0_0.distcp")
    shutil.move(shard, str(tmp_path / "outside.distcp"))
    os.symlink(str(tmp_path / "outside.distcp"), shard)
    for call in (lambda: liferaft.read(dcp), lambda: liferaft.verify(dcp), lambda: liferaft.inspect(dcp)):
        with pytest.raises(UnsafePathError, match="link|outside"):
            call()
    one_error(cli("read", dcp))
    inner = os.path.join(dcp, "inner.distcp")                 # a link to a file inside the folder: a link still
    os.unlink(shard)
    shutil.move(str(tmp_path / "outside.distcp"), inner)
    os.symlink("inner.distcp", shard)
    with pytest.raises(UnsafePathError, match="link"):
        liferaft.read(dcp)


def test_an_hf_shard_linking_inside_its_folder_is_still_a_link(tmp_path):
    src = saved(str(tmp_path / "ck"))
    st = str(tmp_path / "st")
    liferaft.convert(src, st, "safetensors")
    os.rename(os.path.join(st, "model.safetensors"), os.path.join(st, "real.bin"))
    os.symlink("real.bin", os.path.join(st, "model.safetensors"))
    with pytest.raises(LiferaftError, match="link"):
        liferaft.read(st)


# --------------------------------------------------------------------------- writes never through a link


@pytest.mark.parametrize("fmt,planted", [("dcp", "__0_0.distcp"), ("dcp", ".metadata.tmp"),
                                         ("torch", "DST.tmp"), ("safetensors", "model.safetensors.tmp")])
def test_an_export_never_writes_through_a_planted_link(tmp_path, fmt, planted):
    src = saved(str(tmp_path / "ck"))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    if fmt == "torch":
        dst = str(tmp_path / "m.pt")
        os.symlink(str(victim), dst + ".tmp")
    else:
        dst = str(tmp_path / "out")
        os.makedirs(dst)
        os.symlink(str(victim), os.path.join(dst, planted))
    liferaft.convert(src, dst, fmt)
    assert victim.read_bytes() == b"precious"
    out = liferaft.read(dst)
    assert all(torch.equal(out[k], v) for k, v in STATE.items())


def test_storage_writes_replace_a_planted_link_never_write_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    root = tmp_path / "root"
    (root / "data" / "s").mkdir(parents=True)
    os.symlink(str(victim), str(root / "data" / "s" / "r0.bin"))
    os.symlink(str(victim), str(root / "COMMIT"))
    st = PosixStorage(str(root))
    w = st.open_writer("data/s/r0.bin")
    w.pwrite(b"new", 0)
    w.close()
    st.put_atomic("COMMIT", b"marker")
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(root / "COMMIT") and st.read_all("COMMIT") == b"marker"
    assert st.read_all("data/s/r0.bin") == b"new"
    os.symlink(str(tmp_path), str(root / "sub"))          # a folder on the way that is a link
    with pytest.raises(UnsafePathError):
        st.open_writer("sub/x.bin")
    assert not (tmp_path / "x.bin").exists()


def test_the_files_module_refuses_links_fifos_devices_and_oversize(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"12345")
    os.symlink("f", str(tmp_path / "a" / "l"))
    os.symlink(str(tmp_path / "a"), str(tmp_path / "d"))
    os.mkfifo(str(tmp_path / "a" / "p"))
    os.symlink("/dev/zero", str(tmp_path / "z"))
    assert read_capped(str(tmp_path), "a/f", 5) == b"12345"
    for rel, err in (("a/l", UnsafePathError), ("d/f", UnsafePathError), ("z", UnsafePathError),
                     ("../x", UnsafePathError), ("/etc/passwd", UnsafePathError), ("a/p", LiferaftError),
                     ("a", LiferaftError)):
        e = bounded(lambda rel=rel: os.close(open_read(str(tmp_path), rel)))
        assert isinstance(e, err), (rel, e)
    with pytest.raises(LiferaftError, match="more than"):
        read_capped(str(tmp_path), "a/f", 4)
    with pytest.raises(FileNotFoundError):
        open_read(str(tmp_path), "a/missing")
    fd, at = create_exclusive(str(tmp_path), "a/l")          # the link itself is replaced
    os.close(fd)
    os.close(at)
    assert not os.path.islink(tmp_path / "a" / "l") and (tmp_path / "a" / "f").read_bytes() == b"12345"


# --------------------------------------------------------------------------- names too long, folders in the way


@pytest.mark.parametrize("name", ["data/" + "a" * 300 + "/r00000.bin", "data/x/" + "é" * 128 + ".bin",
                                  "../" + "s" * 300 + "/data/x"])
def test_a_manifest_naming_a_component_longer_than_255_bytes_is_refused(tmp_path, name):
    """One rule (format.limits.MAX_NAME_BYTES) for the manifest parser and storage.files: never a raw
    ENAMETOOLONG, and verify reports rather than crashes."""
    ck = saved(str(tmp_path / "ck"))
    point_at(ck, name)
    all_refused(ck, str(tmp_path), cli_too=True)
    with pytest.raises(UnsafePathError, match="255 bytes"):
        liferaft.verify(ck)


def test_the_files_module_maps_every_open_failure_to_a_liferaft_error(tmp_path):
    from liferaft.errors import FileAccessError
    from liferaft.storage.files import open_path

    with pytest.raises(UnsafePathError, match="255 bytes"):
        open_read(str(tmp_path), "x" * 256)
    with pytest.raises(FileAccessError, match="shorter") as e:
        open_path(str(tmp_path / ("x" * 300)))
    assert isinstance(e.value, OSError) and e.value.errno == 36     # still an OSError with its errno
    (tmp_path / "d").mkdir()
    with pytest.raises(FileAccessError, match="folder"):
        create_exclusive(str(tmp_path), "d")
    with pytest.raises(FileNotFoundError):                          # the storage contract: missing stays so
        open_read(str(tmp_path), "missing")


def test_a_dcp_file_name_longer_than_255_bytes_is_refused(tmp_path):
    from liferaft.testing import foreign_files as ff

    dcp = ff.dcp_folder(str(tmp_path / "dcp"))

    def edit(meta):
        for info in meta.storage_data.values():
            object.__setattr__(info, "relative_path", "y" * 300 + ".distcp")
    ff.rewrite_dcp_metadata(dcp, edit)
    for call in (lambda: liferaft.read(dcp), lambda: liferaft.verify(dcp)):
        assert isinstance(bounded(call), LiferaftError)
    one_error(cli("read", dcp))


@pytest.mark.parametrize("fmt,folder", [("safetensors", "model.safetensors"), ("safetensors", "model.safetensors.tmp"),
                                        ("torch", "DST"), ("dcp", ".metadata")])
def test_an_export_onto_a_folder_is_refused_and_leaves_no_temporary_file(tmp_path, fmt, folder):
    src = saved(str(tmp_path / "ck"))
    dst = str(tmp_path / ("m.pt" if fmt == "torch" else "out"))
    if fmt == "torch":
        os.makedirs(dst)
    else:
        os.makedirs(os.path.join(dst, folder))
    e = bounded(lambda: liferaft.convert(src, dst, fmt))
    assert isinstance(e, LiferaftError), e
    where = dst if fmt == "torch" else os.path.join(dst, folder)
    if fmt != "dcp":                                        # (a DCP destination holding .metadata: not empty)
        assert where in str(e) and "folder" in str(e), e
    left = [n for n in os.listdir(os.path.dirname(dst) if fmt == "torch" else dst) if ".tmp" in n]
    assert left in ([], [folder]), left
    one_error(cli("convert", src, dst, "--to", fmt))


@pytest.mark.parametrize("which", ["data", "data/<id>"])
def test_a_linked_folder_is_named_in_the_message_not_the_file_below_it(tmp_path, which):
    ck = saved(str(tmp_path / "ck"))
    folder = os.path.dirname(data_file(ck)) if which == "data/<id>" else os.path.join(ck, "data")
    shutil.move(folder, str(tmp_path / "moved"))
    os.symlink(str(tmp_path / "moved"), folder)
    with pytest.raises(UnsafePathError) as e:
        liferaft.read(ck)
    assert str(e.value).startswith(f"{folder} (a folder on the way to"), e.value


def test_a_folder_where_an_atomic_file_goes_is_a_liferaft_error(tmp_path):
    # (a folder named LEASE in a manager root escaped as IsADirectoryError, from the manager and `liferaft gc`)
    s = PosixStorage(str(tmp_path))
    (tmp_path / "LEASE").mkdir()
    with pytest.raises(LiferaftError, match="LEASE"):
        s.put_atomic("LEASE", b"{}")
    assert sorted(os.listdir(tmp_path)) == ["LEASE"]                # the temporary file removed
