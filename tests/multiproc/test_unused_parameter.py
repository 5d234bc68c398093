"""Issue 14, item 3, as reported: a BertModel under FSDP2 + AdamW with a CheckpointManager on 2 ranks, the loss on
``last_hidden_state`` only, so the pooler never gets a gradient nor AdamW state. The strict restore into a fresh
model and optimizer works, the pooler stays without state, and training goes on bit for bit. (PyTorch DCP refuses
this restore: "Missing key in checkpoint state_dict: optim.state.pooler.dense.weight.step".)"""

from __future__ import annotations

import pytest
from multiproc._pooler_ranks import resume_go_on, train_save_go_on

from liferaft.testing import run_ranks

pytest.importorskip("transformers")


def test_fsdp2_bert_with_an_unused_pooler_restores_strict_and_trains_on_bit_for_bit(tmp_path):
    root = str(tmp_path / "run")
    first = run_ranks(train_save_go_on, 2, root, timeout=300)
    assert [unused for _, unused in first] == [0, 0]
    resumed = run_ranks(resume_go_on, 2, root, timeout=300)
    assert [r[0] for r in resumed] == [2, 2]
    assert [r[2] for r in resumed] == [0, 0]                   # no placeholder state for the pooler
    assert [r[1] for r in resumed] == [losses for losses, _ in first]
