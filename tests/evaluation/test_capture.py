"""capture() records every attention module's weights; uniform_weights() ablates and restores."""

import torch

import attnkit as ak
from attnkit.evaluation import capture, uniform_weights


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = ak.Attention("dot")
        self.mha = ak.MultiHeadAttention(4, 2)

    def forward(self, x):
        return self.mha(self.first(x, x).context).context


def test_capture_records_by_name_even_without_need_weights():
    m = Two()
    x = torch.randn(1, 3, 4)
    with capture(m) as rec:
        m(x)
        m(x)
    assert set(rec) == {"first", "mha.attention"}  # the per-head part reports
    assert len(rec["first"]) == 2 and rec["first"][0].shape == (1, 3, 3)
    assert rec["mha.attention"][0].shape == (1, 2, 3, 3)
    torch.testing.assert_close(rec["first"][0].sum(-1), torch.ones(1, 3))
    m(x)  # hooks are gone
    assert len(rec["first"]) == 2


def test_uniform_ablation_restores_the_alignment():
    m = Two()
    x = torch.randn(1, 3, 4)
    before = m(x)
    with uniform_weights(m), capture(m) as rec:
        m(x)
    torch.testing.assert_close(rec["first"][0], torch.full((1, 3, 3), 1 / 3))
    torch.testing.assert_close(m(x), before)
    assert isinstance(m.first.align, ak.alignments.Softmax)
