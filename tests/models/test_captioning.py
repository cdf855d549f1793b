"""The image captioner: shapes, dtype at construction, and calls that fail clearly."""

import pytest
import torch

import attnkit as ak
from attnkit.models import ImageCaptioner


def _model(**kw):
    torch.manual_seed(0)
    return ImageCaptioner(9, 4, ak.Attention(ak.scores.Additive(4, 4, 4, **kw)), **kw)


def test_built_in_float64_runs_in_float64():
    m = _model(dtype=torch.float64)
    assert {p.dtype for p in m.parameters()} == {torch.float64}
    logits, weights, log_prob = m(
        torch.randn(2, 1, 8, 8, dtype=torch.float64), torch.ones(2, 3, dtype=torch.long)
    )
    assert logits.shape == (2, 3, 9) and weights.shape == (2, 3, 4) and log_prob is None
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("images", "tokens", "error", "match"),
    [
        (
            torch.randn(2, 3, 8, 8),
            torch.ones(2, 3, dtype=torch.long),
            ValueError,
            r"images must be \(B, C, H, W\) with C = 1",
        ),
        (
            torch.randn(2, 1, 8),
            torch.ones(2, 3, dtype=torch.long),
            ValueError,
            r"images must have at least 4 dims",
        ),
        (
            torch.randn(2, 1, 8, 8),
            torch.ones(2, 3),
            TypeError,
            r"tokens must be integer token ids \(B, T\)",
        ),
        (
            torch.randn(2, 1, 8, 8),
            torch.ones(3, 3, dtype=torch.long),
            ValueError,
            r"tokens of shape \(3, 3\) must have the images' batch size 2",
        ),
        (
            torch.randn(2, 1, 8, 8),
            torch.full((2, 3), 9),
            ValueError,
            r"tokens hold ids outside \[0, 9\)",
        ),
        (
            torch.randn(2, 1, 8, 8, dtype=torch.float64),
            torch.ones(2, 3, dtype=torch.long),
            TypeError,
            r"ImageCaptioner.* of dtype torch.float32 but images has torch.float64",
        ),
    ],
)
def test_bad_calls(images, tokens, error, match):
    with pytest.raises(error, match=match):
        _model()(images, tokens)


def test_bad_construction():
    with pytest.raises(ValueError, match=r"vocab must be a positive int, got 0"):
        ImageCaptioner(0, 4, ak.Attention())
    with pytest.raises(TypeError, match=r"attention must be an attnkit Attention, got str"):
        ImageCaptioner(9, 4, "additive")
