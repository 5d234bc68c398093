"""Writing less (issue #6): lossless compression per chunk, incremental saves that reference unchanged chunks,
opt-in 8-bit quantization. Real files, real saves and loads; every lossless path must come back bit for bit."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import liferaft
from liferaft import LoadOptions, SaveOptions
from liferaft.errors import CorruptCheckpointError, LossyCheckpointError, UnsafePathError
from liferaft.format.manifest import check_chunk_file


def manifest(path: str) -> dict:
    marker = json.load(open(os.path.join(path, "COMMIT")))
    return json.load(open(os.path.join(path, marker["manifest"])))


def chunks(path: str, key: str) -> list[dict]:
    return next(t for t in manifest(path)["tensors"] if t["key"] == key)["chunks"]


def weights_like(shape, dtype, seed=0) -> torch.Tensor:
    """Trained-weight-like values: small normal numbers (compressible exponents, random mantissas)."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def zeros_like_state(state):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].contiguous().view(-1).view(torch.uint8),
                                                            b[k].contiguous().view(-1).view(torch.uint8)), k
        else:
            assert a[k] == b[k], k


# ---------------------------------------------------------------------------------------------- compression

def test_compressed_round_trip_is_bit_exact_for_every_dtype(tmp_path):
    state = {
        "bf16": weights_like((700, 300), torch.bfloat16), "fp16": weights_like((300, 301), torch.float16),
        "fp32": weights_like((513, 257), torch.float32), "fp64": weights_like((100, 99), torch.float64),
        "i64": torch.arange(100000) % 7, "mask": torch.rand(200, 300) > 0.5,
        "u8": torch.randint(0, 4, (100000,), dtype=torch.uint8), "f8": weights_like((256, 256), torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5), "strided": weights_like((400, 600), torch.float32).t(),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0] * 30000),
    }
    res = liferaft.save(str(tmp_path / "c"), state, options=SaveOptions(compression="on", chunk_bytes=256 << 10))
    assert res.bytes_encoded > 0 and res.bytes_written < sum(v.numel() * v.element_size() for v in state.values())
    got = zeros_like_state(state)
    liferaft.load(str(tmp_path / "c"), got)
    assert_same(got, state)
    codecs = {t["key"]: {c.get("codec") for c in t["chunks"]} for t in manifest(str(tmp_path / "c"))["tensors"]}
    assert codecs["bf16"] == {"bytegroup-zstd"} and codecs["i64"] == {"bytegroup-zstd"}
    assert manifest(str(tmp_path / "c"))["version"] == 2
    assert liferaft.verify(str(tmp_path / "c")).chunks == sum(len(chunks(str(tmp_path / "c"), k)) for k in state)


def test_incompressible_chunks_are_stored_raw(tmp_path):
    noise = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    liferaft.save(str(tmp_path / "c"), {"noise": noise}, options=SaveOptions(compression="on"))
    (c,) = chunks(str(tmp_path / "c"), "noise")
    assert "codec" not in c and os.path.getsize(tmp_path / "c" / c["file"]) == c["byte_offset"] + (1 << 20)
    assert manifest(str(tmp_path / "c"))["version"] == 1          # nothing needs the newer format


def test_plain_saves_keep_format_version_1(tmp_path):
    liferaft.save(str(tmp_path / "p"), {"w": torch.ones(10)}, options=SaveOptions(compression="off"))
    assert manifest(str(tmp_path / "p"))["version"] == 1
    assert json.load(open(tmp_path / "p" / "COMMIT"))["version"] == 1


def test_resharding_load_decodes_only_the_blocks_it_needs(tmp_path):
    full = weights_like((4096, 512), torch.float32)        # 8 MiB: 64 blocks of 128 KiB
    liferaft.save(str(tmp_path / "c"), {"w": full}, options=SaveOptions(compression="on"))
    part = liferaft.Sharded(torch.zeros(100, 512), (4096, 512), (1000, 0))
    res = liferaft.load(str(tmp_path / "c"), {"w": part})
    assert torch.equal(part.local, full[1000:1100])
    (c,) = chunks(str(tmp_path / "c"), "w")
    assert res.bytes_read <= 3 * max(c["frames"]) < sum(c["frames"]) // 10
    col = liferaft.Sharded(torch.zeros(4096, 100), (4096, 512), (0, 300))       # every block, strided copy
    liferaft.load(str(tmp_path / "c"), {"w": col}, options=LoadOptions(max_read_bytes=1 << 20))
    assert torch.equal(col.local, full[:, 300:400])


def test_a_damaged_compressed_frame_is_named_and_never_loaded(tmp_path):
    full = weights_like((2048, 512), torch.float32)
    path = str(tmp_path / "c")
    liferaft.save(path, {"w": full}, options=SaveOptions(compression="on"))
    (c,) = chunks(path, "w")
    with open(os.path.join(path, c["file"]), "r+b") as f:     # flip a byte inside frame 3
        pos = c["byte_offset"] + sum(c["frames"][:3]) + c["frames"][3] // 2
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x55]))
    target = {"w": torch.zeros(2048, 512)}
    with pytest.raises(CorruptCheckpointError, match=r"'w'") as e:
        liferaft.load(path, target)
    assert c["file"] in str(e.value)
    with pytest.raises(CorruptCheckpointError, match="1 fault"):
        liferaft.verify(path)


def test_async_save_compresses_in_the_background(tmp_path):
    state = {"a": weights_like((1024, 1024), torch.bfloat16), "b": weights_like((1000, 333), torch.float32)}
    h = liferaft.async_save(str(tmp_path / "c"), state, options=SaveOptions(compression="on"))
    res = h.wait()
    assert res.bytes_encoded > 0
    got = zeros_like_state(state)
    liferaft.load(str(tmp_path / "c"), got)
    assert_same(got, state)


def test_a_pool_smaller_than_a_chunk_streams_it_raw(tmp_path):
    state = {"a": weights_like((2048, 1024), torch.float32)}           # 8 MiB chunk, 1 MiB budget
    res = liferaft.save(str(tmp_path / "c"), state,
                        options=SaveOptions(compression="on", memory_budget=1 << 20, chunk_bytes=8 << 20))
    assert res.bytes_encoded == 0
    got = zeros_like_state(state)
    liferaft.load(str(tmp_path / "c"), got)
    assert_same(got, state)
    for budget in (9 << 20, 12 << 20):      # room for the chunk, but maybe not for the stager's padding too
        liferaft.save(str(tmp_path / f"d{budget}"), state,
                      options=SaveOptions(compression="on", memory_budget=budget, chunk_bytes=8 << 20))
        got = zeros_like_state(state)
        liferaft.load(str(tmp_path / f"d{budget}"), got)
        assert_same(got, state)


# ---------------------------------------------------------------------------------------------- incremental

def test_incremental_save_references_unchanged_chunks(tmp_path):
    frozen = weights_like((4096, 1024), torch.float32, seed=1)        # 16 MiB: frozen base weights
    state = {"frozen": frozen, "adapter": weights_like((64, 1024), torch.float32, seed=2), "step": 1}
    a = liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="off"))
    state["adapter"] += 1
    state["step"] = 2
    b = liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a", compression="off"))
    assert b.bytes_reused == 16 << 20 and b.bytes_written == 64 * 1024 * 4 < a.bytes_written // 50
    assert {c["file"].split("/")[1] for c in chunks(str(tmp_path / "b"), "frozen")} == {"a"}
    got = zeros_like_state(state)
    liferaft.load(str(tmp_path / "b"), got)
    assert_same(got, state)
    assert liferaft.verify(str(tmp_path / "b")).bytes_checked == (16 << 20) + 64 * 1024 * 4
    assert torch.equal(liferaft.read(str(tmp_path / "b"))["frozen"], frozen)
    # a third save references the owner of the bytes (a), not b: references never chain
    state["step"] = 3
    liferaft.save(str(tmp_path / "c"), state, options=SaveOptions(incremental_base="b", compression="off",
                                                                   reference_min_share=0))
    assert {c["file"].split("/")[1] for c in chunks(str(tmp_path / "c"), "frozen")} == {"a"}
    assert {c["file"].split("/")[1] for c in chunks(str(tmp_path / "c"), "adapter")} == {"b"}
    # by default the adapter (1.5 % of the bytes) is copied from b rather than keep b alive for it
    liferaft.save(str(tmp_path / "d"), state, options=SaveOptions(incremental_base="b", compression="off"))
    assert {c["file"].split("/")[1] for c in chunks(str(tmp_path / "d"), "frozen")} == {"a"}
    assert not chunks(str(tmp_path / "d"), "adapter")[0]["file"].startswith("../")


def test_only_the_changed_part_of_a_large_tensor_is_written(tmp_path):
    emb = weights_like((16384, 512), torch.float32)                     # 32 MiB embedding, 1 MiB chunks
    opts = SaveOptions(chunk_bytes=1 << 20, compression="off")
    liferaft.save(str(tmp_path / "a"), {"emb": emb}, options=opts)
    emb[100] += 1                                                        # rows of two chunks touched
    emb[9000:9003] -= 1
    b = liferaft.save(str(tmp_path / "b"), {"emb": emb}, options=SaveOptions(
        chunk_bytes=1 << 20, compression="off", incremental_base="a"))
    assert b.bytes_written == 2 << 20 and b.bytes_reused == 30 << 20
    got = {"emb": torch.zeros_like(emb)}
    liferaft.load(str(tmp_path / "b"), got)
    assert torch.equal(got["emb"], emb)


def test_incremental_and_compression_combine(tmp_path):
    state = {"w": weights_like((2048, 1024), torch.bfloat16), "o": weights_like((2048, 1024), torch.float32, 3)}
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(compression="on"))
    state["o"] *= 1.5
    b = liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(compression="on", incremental_base="a"))
    assert b.bytes_reused == 4 << 20 and 0 < b.bytes_written < 8 << 20
    got = zeros_like_state(state)
    liferaft.load(str(tmp_path / "b"), got)
    assert_same(got, state)


def test_a_missing_base_file_fails_the_load_naming_it(tmp_path):
    state = {"w": weights_like((1024, 256), torch.float32), "x": torch.zeros(3)}
    liferaft.save(str(tmp_path / "a"), state)
    state["x"] += 1
    liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="a"))
    (c,) = chunks(str(tmp_path / "b"), "w")
    os.remove(tmp_path / c["file"][3:])
    with pytest.raises(CorruptCheckpointError, match=r"\.\./a/data/.*missing"):
        liferaft.load(str(tmp_path / "b"), zeros_like_state(state))
    with pytest.raises(CorruptCheckpointError, match="missing"):
        liferaft.verify(str(tmp_path / "b"))


def test_an_unusable_base_means_a_full_save_with_a_warning(tmp_path):
    state = {"w": torch.ones(1000)}
    with pytest.warns(UserWarning, match="incremental base 'nope' cannot be used"):
        r = liferaft.save(str(tmp_path / "b"), state, options=SaveOptions(incremental_base="nope"))
    assert r.bytes_written == 4000 and r.bytes_reused == 0


def test_manifest_file_paths_may_name_only_a_sibling_checkpoint():
    assert check_chunk_file("../step-0000000001/data/ab/r00000.bin")
    assert check_chunk_file("data/ab/r00000.bin")
    for bad in ("../../x/data/r.bin", "../a/../../b", "../a", "../../a/b", "/abs/a", "../a/./b", "../.. /b"[:-3]):
        with pytest.raises(UnsafePathError):
            check_chunk_file(bad)


# ---------------------------------------------------------------------------------------------- lossy

def test_quantized_moments_bounded_error_reported_and_refused_for_exact_resume(tmp_path):
    torch.manual_seed(0)
    state = {"w": weights_like((512, 512), torch.float32), "exp_avg": torch.randn(512, 512) * 1e-3,
             "exp_avg_sq": torch.rand(1000, 300) * 1e-6, "count": torch.arange(10),
             "bad": torch.tensor([1.0, float("inf")] * 1000)}
    liferaft.save(str(tmp_path / "q"), state, options=SaveOptions(quantize=("exp_avg*", "count", "bad")))
    got = zeros_like_state(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = liferaft.load(str(tmp_path / "q"), got)
    assert set(res.lossy) == {"exp_avg", "exp_avg_sq"}           # ints are never quantized; inf → lossless
    assert any("stored lossily" in str(w.message) and "exp_avg" in str(w.message) for w in caught)
    for k in ("exp_avg", "exp_avg_sq"):
        err = (got[k] - state[k]).abs()
        groups = state[k].reshape(-1)
        bound = float(groups.abs().max()) / 254 * 1.0001
        assert 0 < float(err.max()) <= bound and float(err.max()) == pytest.approx(res.lossy[k]["max_abs_error"])
        assert res.lossy[k]["mean_abs_error"] == pytest.approx(float(err.mean()), rel=1e-3)
    assert_same({k: got[k] for k in ("w", "count", "bad")}, {k: state[k] for k in ("w", "count", "bad")})
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "q" / "data") for f in fs)
    assert stored < (512 * 512 + 1000 * 300) * 4 // 3 + 512 * 512 * 4 + 2000 * 4 + 80 + 65536
    with pytest.raises(LossyCheckpointError, match="exp_avg"):
        liferaft.load(str(tmp_path / "q"), zeros_like_state(state), options=LoadOptions(exact=True))
    only_exact = {"w": torch.zeros(512, 512)}
    liferaft.load(str(tmp_path / "q"), only_exact, strict=False, options=LoadOptions(exact=True))  # w is exact
    assert torch.equal(only_exact["w"], state["w"])
    assert liferaft.verify(str(tmp_path / "q")).chunks == 5


def test_an_ordered_dict_state_dict_is_walked_like_a_dict(tmp_path):
    from collections import OrderedDict

    sd = OrderedDict(w=torch.randn(4, 4), b=torch.zeros(4))
    liferaft.save(str(tmp_path / "o"), {"model": sd, "step": 3})
    got = {"model": OrderedDict(w=torch.zeros(4, 4), b=torch.ones(4)), "step": 0}
    liferaft.load(str(tmp_path / "o"), got)
    assert torch.equal(got["model"]["w"], sd["w"]) and got["step"] == 3 and isinstance(got["model"], OrderedDict)


# ---------------------------------------------------------------------------------------------- xor delta

def test_xor_delta_of_slowly_changing_states_round_trips_and_is_smaller(tmp_path):
    w = weights_like((2048, 1024), torch.float32)
    m = torch.rand(2048, 1024) * 1e-4
    state = {"w": w, "optim": {"m": m}}
    opts = dict(compression="on", delta=("optim.*", "w"))
    liferaft.save(str(tmp_path / "a"), state, options=SaveOptions(**opts))
    paths = ["a"]
    for i in range(1, 4):                                   # small updates, as between checkpoints
        w.add_(torch.randn_like(w) * 1e-5)
        m.mul_(0.999).add_(torch.rand_like(m) * 1e-7)
        paths.append(f"s{i}")
        r = liferaft.save(str(tmp_path / paths[-1]), state,
                          options=SaveOptions(**opts, incremental_base=paths[-2]))
        plain = liferaft.save(str(tmp_path / f"p{i}"), state, options=SaveOptions(compression="on"))
        assert r.bytes_written < plain.bytes_written
        c = chunks(str(tmp_path / paths[-1]), "w")[0]
        assert c["delta"]["file"].startswith("../a/") and "delta" not in c["delta"]     # always against a whole one
        got = {"w": torch.zeros_like(w), "optim": {"m": torch.zeros_like(m)}}
        liferaft.load(str(tmp_path / paths[-1]), got)
        assert torch.equal(got["w"], w) and torch.equal(got["optim"]["m"], m)
        part = liferaft.Sharded(torch.zeros(100, 1024), (2048, 1024), (1500, 0))
        liferaft.load(str(tmp_path / paths[-1]), {"w": part}, strict=False)
        assert torch.equal(part.local, w[1500:1600])
        liferaft.verify(str(tmp_path / paths[-1]))


def test_a_damaged_delta_base_is_detected(tmp_path):
    w = weights_like((512, 512), torch.float32)
    liferaft.save(str(tmp_path / "a"), {"w": w}, options=SaveOptions(compression="off"))
    w.add_(1e-4)
    liferaft.save(str(tmp_path / "b"), {"w": w}, options=SaveOptions(delta=("w",), incremental_base="a"))
    (c,) = chunks(str(tmp_path / "a"), "w")
    with open(tmp_path / "a" / c["file"], "r+b") as f:
        f.seek(c["byte_offset"] + 1000)
        f.write(b"\xff\xff")
    with pytest.raises(CorruptCheckpointError, match=r"\.\./a/data"):
        liferaft.load(str(tmp_path / "b"), {"w": torch.zeros(512, 512)})
    with pytest.raises(CorruptCheckpointError):
        liferaft.verify(str(tmp_path / "b"))


# ---------------------------------------------------------------------------------------------- selective

def test_selective_save_skips_chunks_that_barely_changed_and_composes_the_state(tmp_path):
    layers = {f"layer{i}": weights_like((1024, 1024), torch.float32, seed=i) for i in range(4)}   # 4 MiB each
    state = {"model": layers, "step": 0}
    liferaft.save(str(tmp_path / "a"), state)
    layers["layer0"].add_(torch.randn(1024, 1024) * 1e-2)        # relative change ~0.5: saved
    layers["layer1"].add_(torch.randn(1024, 1024) * 1e-6)        # ~5e-5: below the threshold, not saved
    state["step"] = 1
    opts = SaveOptions(incremental_base="a", selective=1e-3, selective_keys=("model.*",))
    r = liferaft.save(str(tmp_path / "b"), state, options=opts)
    assert r.bytes_written == 4 << 20 and r.bytes_reused == 12 << 20
    m = {t["key"]: t for t in manifest(str(tmp_path / "b"))["tensors"]}
    assert "lossy" not in m["model.layer0"] and "lossy" not in m["model.layer2"]      # changed / identical
    stale = m["model.layer1"]["lossy"]
    assert stale["method"] == "selective" and stale["from"] == ["a"] and 0 < stale["max_change"] < 1e-3
    got = {"model": {k: torch.zeros_like(v) for k, v in layers.items()}, "step": -1}
    with pytest.warns(UserWarning, match="taken from a"):
        res = liferaft.load(str(tmp_path / "b"), got)
    assert set(res.lossy) == {"model.layer1"} and got["step"] == 1
    assert torch.equal(got["model"]["layer0"], layers["layer0"])
    old = liferaft.read(str(tmp_path / "a"))["model"]["layer1"]
    assert torch.equal(got["model"]["layer1"], old)                 # the composed state: layer1 from step a
    rel = float((old.double() - layers["layer1"].double()).norm() / old.double().norm())
    assert rel == pytest.approx(stale["max_change"], rel=1e-6)
    with pytest.raises(LossyCheckpointError, match="taken from a"):
        liferaft.load(str(tmp_path / "b"), got, options=LoadOptions(exact=True))
    # the next save measures the change against what is stored (step a's values), so drift stays bounded
    layers["layer1"].add_(torch.randn(1024, 1024) * 1e-4)          # now ~5e-3 away from a's values: saved
    r = liferaft.save(str(tmp_path / "c"), state, options=SaveOptions(incremental_base="b", selective=1e-3))
    m = {t["key"]: t for t in manifest(str(tmp_path / "c"))["tensors"]}
    assert "lossy" not in m["model.layer1"] and r.bytes_written == 4 << 20


@pytest.mark.parametrize("spelled", ["alias", "b", "x/../b"])
def test_a_save_over_its_own_base_through_a_link_or_another_spelling_writes_its_chunks_again(tmp_path, spelled):
    """Saving to a link to ``b`` (or ``b`` spelled otherwise) with ``b`` as the incremental base: the base's
    chunks lie in the checkpoint being replaced, whose old files the commit removes, so none is referenced."""
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 0}
    liferaft.save(str(tmp_path / "b"), state)
    os.symlink("b", tmp_path / "alias")
    (tmp_path / "x").mkdir()
    state["step"] = 1
    res = liferaft.save(str(tmp_path / spelled), state,
                        options=liferaft.SaveOptions(incremental_base="b", overwrite=True))
    assert res.bytes_reused == 0
    for path in (tmp_path / spelled, tmp_path / "b"):
        got = {"w": torch.zeros(4096), "step": -1}
        liferaft.load(str(path), got)
        assert torch.equal(got["w"], state["w"]) and got["step"] == 1


def test_metadata_nested_deeper_than_a_reader_reads_is_refused_before_anything_is_written(tmp_path):
    deep: dict = {}
    inner = deep
    for _ in range(150):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(liferaft.OptionsError, match="nests more than 100"):
        liferaft.save(str(tmp_path / "c"), {"w": torch.ones(2)}, options=SaveOptions(metadata=deep))
    assert not (tmp_path / "c").exists()
