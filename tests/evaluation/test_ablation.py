"""uniform_weights() replaces every alignment part by uniform weights, also inside multi-head
attention and mechanisms that hold their own alignment, and restores them."""

import torch

import attnkit as ak
from attnkit.evaluation import capture, uniform_weights


def test_multihead_attention_aligns_uniformly_and_is_restored():
    mha = ak.MultiHeadAttention(8, 2, align="sparsemax")
    x = torch.randn(2, 5, 8)
    mask = ak.masks.from_lengths(torch.tensor([5, 3]), 5)
    before = mha(x, mask=mask).context
    with uniform_weights(mha), capture(mha) as records:
        mha(x, mask=mask)
    w = records["attention"][0]
    expected = mask.float().unsqueeze(1).expand(2, 2, 5, 5) / mask.sum(-1).view(2, 1, 1, 1)
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(mha(x, mask=mask).context, before)
    assert isinstance(mha.align, ak.alignments.Sparsemax)
    assert "align" not in mha._modules  # nothing left behind on the multi-head module


def test_mechanisms_with_their_own_alignment_align_uniformly():
    for name in ak.mechanisms.available():
        module, args, kwargs = ak.mechanisms.example(name)
        holders = [m for m in module.modules() if "align" in m._modules]
        if not holders:
            continue
        originals = [m.align for m in holders]
        with uniform_weights(module):
            assert all(isinstance(m.align, ak.alignments.Uniform) for m in holders), name
            module(*args, **kwargs)
        assert [m.align for m in holders] == originals, name
