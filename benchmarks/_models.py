"""A real model to checkpoint for the write-less benchmarks: a GPT-style transformer trained with AdamW on
random tokens, in four regimes (full training; full training but for a few parameters without gradient; fine-tuning
with most layers frozen; LoRA adapters).

``build(regime, size)`` returns (model, optimizer, step function); ``state(model, opt)`` the checkpointed state:
``get_state_dict`` of torch.distributed.checkpoint (the FQN-keyed model and optimizer state dicts that DCP
saves), the same dict for every library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SIZES = {"quick": (2048, 256, 4), "small": (8192, 512, 8), "medium": (16384, 768, 12)}   # vocab, dim, layers
SEQ = 64


class LoRALinear(nn.Module):
    """``base(x) + B(A(x)) * scale`` with the base frozen (LoRA, rank ``r``)."""

    def __init__(self, base: nn.Linear, r: int = 8) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.heads = max(1, dim // 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def build(regime: str, size: str = "small") -> tuple[nn.Module, torch.optim.Optimizer, Callable[[int], float]]:
    """``regime``: "full" (everything trains), "crumbs" (everything but the position embedding and the final
    LayerNorm, which get no gradient: ~0.2 % of the checkpoint stays the same, as BERT's pooler does), "frozen90" (embeddings, head and all but the last block frozen:
    about 90 % of the parameters), "lora" (every weight frozen, rank-8 adapters on each block's linears)."""
    vocab, dim, layers = SIZES[size]
    model = GPT(vocab, dim, layers)
    if regime == "crumbs":            # everything trains but a few parameters that get no gradient (BERT's pooler)
        for p in list(model.ln.parameters()) + [model.pos]:
            p.requires_grad_(False)
    elif regime == "frozen90":
        for p in model.parameters():
            p.requires_grad_(False)
        for p in list(model.blocks[-1].parameters()) + list(model.ln.parameters()):
            p.requires_grad_(True)
    elif regime == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        for b in model.blocks:
            for name in ("qkv", "proj", "up", "down"):
                setattr(b, name, LoRALinear(getattr(b, name)))
    elif regime != "full":
        raise ValueError(regime)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step(i: int) -> float:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, vocab, (8, SEQ + 1), generator=g)
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return model, opt, step


def state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The checkpointed state: FQN-keyed model and optimizer state dicts (``get_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def frozen_share(model: nn.Module) -> tuple[float, float]:
    """(share of parameters frozen, share of the checkpoint's tensor bytes they are)."""
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    trainable = total - frozen
    ckpt = total + 2 * trainable            # weights + AdamW's exp_avg and exp_avg_sq of the trainable ones
    return frozen / total, frozen / ckpt
