"""Bad calls raise ValueError/TypeError whose message names the argument and the shapes."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak


def q_(*s, dtype=torch.float32):
    return torch.randn(*s, dtype=dtype)


BAD_CALLS = [
    ("q of rank 1", lambda: ak.attention(q_(4), q_(2, 5, 4)), ValueError, r"q must have at least 2 dims.*\(4,\)"),
    ("k of rank 1", lambda: ak.attention(q_(2, 3, 4), q_(4)), ValueError, r"k must have at least 2 dims"),
    ("d_q != d_k for dot", lambda: ak.attention(q_(2, 3, 5), q_(2, 6, 4), score="dot"), ValueError, r"d_q == d_k.*\(2, 3, 5\).*\(2, 6, 4\)"),
    ("d_q != d_k for scaled_dot", lambda: ak.attention(q_(2, 3, 5), q_(2, 6, 4)), ValueError, r"d_q == d_k"),
    ("v length != k length", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), q_(2, 5, 3)), ValueError, r"v has 5 values \(shape \(2, 5, 3\)\) but k has 6 keys"),
    ("mask of wrong shape", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=torch.ones(2, 3, 5, dtype=torch.bool)), ValueError, r"mask of shape \(2, 3, 5\) does not broadcast.*\(2, 3, 6\)"),
    ("mask with too many dims", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=torch.ones(1, 2, 3, 6, dtype=torch.bool)), ValueError, r"mask of shape \(1, 2, 3, 6\)"),
    ("mask of float dtype", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=torch.ones(2, 3, 6)), TypeError, r"mask must be boolean.*torch.float32"),
    ("mask not a tensor", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=[[True]]), TypeError, r"mask must be a torch.Tensor"),
    ("integer q", lambda: ak.attention(torch.ones(2, 3, 4, dtype=torch.long), q_(2, 6, 4)), TypeError, r"q must be a floating-point tensor, got dtype torch.int64"),
    ("integer v", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), torch.ones(2, 6, 4, dtype=torch.int32)), TypeError, r"v must be a floating-point"),
    ("N = 0", lambda: ak.attention(q_(2, 3, 4), q_(2, 0, 4)), ValueError, r"k has no keys \(N = 0, shape \(2, 0, 4\)\)"),
    ("unknown score name", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score="scaled_dott"), ValueError, r"unknown score 'scaled_dott'; did you mean 'scaled_dot'\?"),
    ("unknown alignment name", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), align="softmx"), ValueError, r"unknown alignment 'softmx'; did you mean 'softmax'\?.*sparsemax"),
    ("parametrised score by name", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score="additive"), TypeError, r"score 'additive' has parameters"),
    ("unknown kwarg to build", lambda: ak.scores.build("additive", d_q=4, d_k=4, d_ww=8), TypeError, r"score 'additive'.*d_ww"),
    ("missing kwarg to build", lambda: ak.scores.build("general", d_q=4), TypeError, r"score 'general'.*d_k"),
    ("mixed dtypes", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4, dtype=torch.float64)), TypeError, r"k has dtype torch.float64 but q has torch.float32"),
    ("mixed devices", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4).to("meta")), ValueError, r"k is on meta but q is on cpu"),
    ("window larger than sequence", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), align=ak.alignments.Local(3)), ValueError, r"local window of 2·3\+1 = 7 keys is larger than the sequence.*N = 6"),
    ("batch dims do not broadcast", lambda: ak.attention(q_(2, 3, 4), q_(3, 6, 4)), ValueError, r"batch dims of q \(2, 3, 4\), k \(3, 6, 4\)"),
    ("bias of wrong shape", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), bias=torch.zeros(3, 5)), ValueError, r"bias of shape \(3, 5\) does not broadcast"),
    ("multi-dim score with wrong d_v", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), q_(2, 6, 5), score=ak.scores.Additive(4, 4, 8, d_out=3)), ValueError, r"d_out = 3.*d_v = 5"),
    ("q=None for a score that needs a query", lambda: ak.attention(None, q_(2, 6, 4)), ValueError, r"q is None but the ScaledDot score needs a query"),
    ("score of the wrong type", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score=torch.nn.Linear(2, 2)), TypeError, r"score must be a registered name or an attnkit Score"),
    ("chunk_size not positive", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score="dot", align="sparsemax", chunk_size=-1), ValueError, r"chunk_size must be a positive int, got -1"),
    ("chunk_size with a non-streaming alignment", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), align="reinforced", chunk_size=2), ValueError, r"does not support the Reinforced alignment"),
    ("embed_dim not divisible", lambda: ak.MultiHeadAttention(10, 3), ValueError, r"embed_dim = 10 is not divisible by num_heads = 3"),
    ("MHA query of wrong width", lambda: ak.MultiHeadAttention(8, 2)(q_(2, 3, 6)), ValueError, r"query has 6 features \(shape \(2, 3, 6\)\) but this MultiHeadAttention expects 8"),
    ("MHA key of wrong width", lambda: ak.MultiHeadAttention(8, 2, kdim=5)(q_(2, 3, 8), q_(2, 4, 8), q_(2, 4, 8)), ValueError, r"key has 8 features.*expects 5"),
    ("negative dropout", lambda: ak.Attention(dropout=-0.1), ValueError, r"dropout must be in \[0, 1\)"),
    ("location score beyond max_len", lambda: ak.attention(q_(2, 3, 4), q_(2, 9, 4), score=ak.scores.Location(4, 8)), ValueError, r"N = 9 keys.*max_len = 8"),
    ("negative window", lambda: ak.alignments.Local(-1), ValueError, r"window must be an int >= 0, got -1"),
    ("unknown activation", lambda: ak.scores.Additive(4, 4, 8, activation="tanhh"), ValueError, r"unknown activation 'tanhh'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "call", "error", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
def test_bad_call(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_table_is_big_enough():
    assert len(BAD_CALLS) >= 15
