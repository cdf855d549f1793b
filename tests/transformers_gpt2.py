"""A small GPT-2 with transformers' eager attention in float64, and a padded batch for it: the
model the swap's per-call and mask tests compare against (tests/integrations/)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

#: the tolerance of a float64 comparison with transformers' eager attention
TIGHT = {"atol": 1e-12, "rtol": 1e-12}


def gpt2_eager(**extra) -> GPT2LMHeadModel:
    """GPT-2 (2 layers, 4 heads of 4, vocabulary 50) without dropout, eager attention, float64,
    eval; ``extra`` goes to its config."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=50,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        **extra,
    )
    return GPT2LMHeadModel(config).double().eval()


def ids_and_padding() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (3, 10) and their attention mask: full, 7 and 4 tokens long."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask
