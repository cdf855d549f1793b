"""Attention-via-attention (Fig. 7) and hierarchical attention (Fig. 8) against loops; padding
of words and sentences never leaks."""

import pytest
import torch
from features.batching import assert_batch_equals_items
from features.test_coattention import additive, softmax, weighted
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.features import AttentionViaAttention, HierarchicalAttention


def test_attention_via_attention():
    torch.manual_seed(0)
    m = AttentionViaAttention(3, 4, 5, 6, dtype=torch.float64)
    q, words, chars = rand(2, 3, seed=1), rand(2, 4, 4, seed=2), rand(2, 7, 5, seed=3)

    def loop():
        rows = []
        for b in range(2):
            W, C = list(words[b]), list(chars[b])
            c_w = weighted(softmax([additive(m.word.score, q[b], k) for k in W]), W)
            qc = torch.cat([q[b], c_w])
            c_c = weighted(softmax([additive(m.char.score, qc, k) for k in C]), C)
            rows.append(torch.cat([c_w, c_c]))
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: m(q, words, chars)[0],
        loop,
        [q, words, chars, *m.parameters()],
        atol=1e-12,
        rtol=1e-12,
    )


def test_hierarchical_loop_with_ragged_documents():
    torch.manual_seed(0)
    m = HierarchicalAttention(4, 5, dtype=torch.float64)
    docs = rand(2, 3, 4, 4, seed=1)
    mask = torch.tensor(
        [
            [[True, True, True, False], [True, False, False, False], [True] * 4],
            [[True, True, False, False], [False] * 4, [False] * 4],  # one real sentence
        ]
    )

    def loop():
        out = []
        for b in range(2):
            sents = []
            for s in range(3):
                words = [docs[b, s, w] for w in range(4) if mask[b, s, w]]
                if words:
                    a = softmax([additive(m.word.score, None, x) for x in words])
                    sents.append(weighted(a, words))
            a = softmax([additive(m.sentence.score, None, x) for x in sents])
            out.append(weighted(a, sents))
        return torch.stack(out)

    assert_same_forward_backward(
        lambda: m(docs, mask).document, loop, [docs, *m.parameters()], atol=1e-12, rtol=1e-12
    )


def test_hierarchical_padding_does_not_leak():
    torch.manual_seed(0)
    m = HierarchicalAttention(4, 5).double()
    docs = rand(1, 3, 4, 4, seed=1, grad=False)
    mask = torch.tensor([[[True, True, False, False], [True] * 3 + [False], [False] * 4]])
    base = m(docs, mask)
    noisy = docs.clone()
    noisy[~mask] = 1e3  # garbage in every padded slot
    torch.testing.assert_close(m(noisy, mask).document, base.document)
    assert (base.sentence_weights[0, 2] == 0).all() and (base.word_weights[~mask] == 0).all()
    trimmed = m(docs[:, :2, :3], mask[:, :2, :3])
    torch.testing.assert_close(trimmed.document, base.document)


def test_attention_via_attention_batch_equals_items_with_masks_from_lengths():
    torch.manual_seed(0)
    m = AttentionViaAttention(3, 4, 5, 6).double()
    q, words, chars = rand(3, 3, seed=1), rand(3, 4, 4, seed=2), rand(3, 7, 5, seed=3)
    assert_batch_equals_items(
        lambda xs, ms: m(xs[0], xs[1], xs[2], ms[1], ms[2])[0],
        [q.detach(), words.detach(), chars.detach()],
        [None, [4, 2, 1], [3, 7, 5]],
    )


def test_hierarchical_batch_equals_items_with_masks_from_lengths():
    torch.manual_seed(0)
    m = HierarchicalAttention(4, 5).double()
    docs = rand(3, 2, 4, 4, seed=1, grad=False)
    lengths = torch.tensor([[4, 2], [1, 0], [3, 3]])
    mask = ak.masks.from_lengths(lengths.flatten(), 4).reshape(3, 2, 1, 4)  # (B, S, 1, W)
    out = m(docs, mask)
    torch.testing.assert_close(out.document, m(docs, mask.squeeze(-2)).document)
    for b in range(3):
        alone = m(docs[b : b + 1], mask[b : b + 1]).document
        torch.testing.assert_close(out.document[b : b + 1], alone)
    # Item 1 has one sentence of one word: the document is that word.
    torch.testing.assert_close(out.document[1], docs[1, 0, 0])


def test_levels_refuse_masks_that_do_not_fit():
    m = AttentionViaAttention(3, 4, 5, 6)
    q, words, chars = torch.randn(3, 3), torch.randn(3, 4, 4), torch.randn(3, 7, 5)
    with pytest.raises(ValueError, match=r"word_mask of shape \(4,\) does not fit words"):
        m(q, words, chars, torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"char_mask of shape \(1, 7\)"):
        m(q, words, chars, None, torch.ones(1, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"query must be \(B, M, d_q\) or \(B, d_q\) with d_q = 3"):
        m(torch.randn(3, 4), words, chars)
    with pytest.raises(ValueError, match=r"chars has batch size 2"):
        m(q, words, chars[:2])
    h = HierarchicalAttention(4, 5)
    with pytest.raises(ValueError, match=r"word_mask of shape \(2, 4\) does not fit words"):
        h(torch.randn(2, 3, 4, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"words must be \(B, S, W, d\), got shape \(2, 4, 4\)"):
        h(torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match=r"words has 3 features .* d = 4"):
        h(torch.randn(2, 3, 4, 3))
