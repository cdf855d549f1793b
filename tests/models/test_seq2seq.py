"""The attention encoder-decoder: shapes, padding, and hard attention's log-probabilities."""

import torch

import attnkit as ak
from attnkit.models import Seq2SeqAttention


def test_padding_does_not_change_the_output():
    torch.manual_seed(0)
    m = Seq2SeqAttention(10, 12, 8, ak.Attention(ak.scores.Additive(8, 16, 8))).eval()
    src = torch.randint(1, 10, (1, 5))
    tgt = torch.randint(0, 12, (1, 4))
    padded = torch.cat([src, torch.randint(1, 10, (1, 3))], 1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    a = m(src, tgt)
    # The GRU reads the padding too (no packing), so compare the attention mask's effect only:
    b = m(padded, tgt, mask)
    assert b.weights.shape == (1, 4, 8) and (b.weights[..., 5:] == 0).all()
    torch.testing.assert_close(b.weights.sum(-1), torch.ones(1, 4))
    assert a.logits.shape == (1, 4, 12)


def test_hard_attention_reports_log_probabilities():
    m = Seq2SeqAttention(10, 12, 8, ak.Attention(ak.scores.Additive(8, 16, 8), "hard"))
    out = m(torch.randint(0, 10, (2, 5)), torch.randint(0, 12, (2, 3)))
    assert out.log_prob.shape == (2, 3)
