"""Rank functions: a transformers BertModel whose pooler the loss never uses, under FSDP2 + AdamW and a
CheckpointManager, as in issue 14 (imported as ``multiproc._pooler_ranks``)."""

from __future__ import annotations

import torch

import liferaft


def bert(seed: int):
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(cfg)                       # with a pooler that gets no gradient
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def steps(model, opt, rank: int, which: range) -> list[float]:
    losses = []
    for i in which:
        ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(100 * i + rank))
        loss = model(input_ids=ids).last_hidden_state.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pooler_state(model, opt) -> int:
    pooler = {id(p) for p in model.pooler.parameters()}
    return sum(1 for p in opt.state if id(p) in pooler)


def train_save_go_on(rank: int, world: int, root: str) -> tuple[list[float], int]:
    model, opt = bert(0)
    steps(model, opt, rank, range(3))
    mgr = liferaft.CheckpointManager(root, every_steps=1)
    mgr.maybe_save(2, {"model": model, "optim": opt, "step": 2}, force=True)
    mgr.close()
    return steps(model, opt, rank, range(3, 6)), pooler_state(model, opt)


def resume_go_on(rank: int, world: int, root: str) -> tuple[int | None, list[float], int]:
    model, opt = bert(1)                                       # another init: everything comes from the step
    mgr = liferaft.CheckpointManager(root, every_steps=1)
    state = {"model": model, "optim": opt, "step": 0}
    got = mgr.restore(state)                                   # strict
    mgr.close()
    unused = pooler_state(model, opt)
    return got, steps(model, opt, rank, range(3, 6)), unused
