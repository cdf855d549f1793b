"""The attention-sum reader (Kadlec et al. 2016): weights from the paper's eq. 1 and candidate
probabilities as a loop summing the weights of each candidate's occurrences (eq. 2)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.queries import AttentionSumReader, occurrences


def _loop(m, document, question, tokens, candidates):
    """One example without padding: s_i = softmax_i(f_i · g) with f_i = [→h_i; ←h_i] and
    g = [→h_last; ←h_first] of the question, then P(w) = Σ_{i: token_i = w} s_i."""
    f, _ = m.document_encoder(document[None])
    q, _ = m.question_encoder(question[None])
    h = m.question_encoder.hidden_size
    g = torch.cat([q[0, -1, :h], q[0, 0, h:]])  # forward's last state, backward's first
    e = [f[0, i] @ g for i in range(document.shape[0])]
    z = sum(torch.exp(x) for x in e)
    s = [torch.exp(x) / z for x in e]
    probs = []
    for w in candidates.tolist():
        total = torch.zeros((), dtype=document.dtype)
        for i, t in enumerate(tokens.tolist()):
            if t == w:
                total = total + s[i]
        probs.append(total)
    return torch.stack(probs), torch.stack(s)


def test_sum_of_weights_per_candidate_matches_the_loop():
    torch.manual_seed(0)
    m = AttentionSumReader(3, 4).double()
    doc, que = rand(2, 6, 3, seed=1), rand(2, 4, 3, seed=2)
    tokens = torch.tensor([[7, 3, 7, 5, 3, 7], [2, 9, 9, 4, 0, 0]])
    candidates = torch.tensor([[7, 3, 5, 8], [9, 2, 4, 6]])  # 8 and 6 never occur
    dl, ql = [6, 4], [4, 2]
    dmask = ak.masks.from_lengths(torch.tensor(dl), 6)
    qmask = ak.masks.from_lengths(torch.tensor(ql), 4)
    occ = occurrences(tokens, candidates)
    out = m(doc, que, occ, dmask, qmask)

    def slow():
        return torch.stack(
            [
                _loop(m, doc[b, : dl[b]], que[b, : ql[b]], tokens[b, : dl[b]], candidates[b])[0]
                for b in range(2)
            ]
        )

    assert_same_forward_backward(
        lambda: m(doc, que, occ, dmask, qmask).probabilities,
        slow,
        [doc, que, *m.parameters()],
        atol=1e-12,
        rtol=1e-10,
    )
    for b in range(2):
        _, s = _loop(m, doc[b, : dl[b]], que[b, : ql[b]], tokens[b, : dl[b]], candidates[b])
        torch.testing.assert_close(out.weights[b, : dl[b]], s)
    assert (out.probabilities[:, 3] == 0).all()  # a candidate with no occurrence
    # every document token is a candidate in the first example: the probabilities sum to 1
    torch.testing.assert_close(out.probabilities[0, :3].sum(), torch.tensor(1.0).double())


def test_occurrences():
    occ = occurrences(torch.tensor([[1, 2, 1]]), torch.tensor([[1, 3]]))
    assert occ.tolist() == [[[True, False], [False, False], [True, False]]]
    with pytest.raises(ValueError, match="tokens must be"):
        occurrences(torch.tensor([1, 2]), torch.tensor([[1]]))


def test_bad_inputs_are_refused():
    m = AttentionSumReader(3, 2)
    doc, que = torch.randn(2, 5, 3), torch.randn(2, 3, 3)
    occ = torch.zeros(2, 5, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="occurrence must be a bool"):
        m(doc, que, occ.float())
    with pytest.raises(ValueError, match="prefix"):
        m(doc, que, occ, torch.tensor([[True, False, True, True, True]] * 2))
    with pytest.raises(ValueError, match="question has 4 features"):
        m(doc, torch.randn(2, 3, 4), occ)
