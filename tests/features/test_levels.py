"""Attention-via-attention (Fig. 7) and hierarchical attention (Fig. 8) against loops; padding
of words and sentences never leaks."""

import torch
from features.test_coattention import additive, softmax, weighted
from helpers import assert_same_forward_backward, rand

from attnkit.features import AttentionViaAttention, HierarchicalAttention


def test_attention_via_attention():
    torch.manual_seed(0)
    m = AttentionViaAttention(3, 4, 5, 6).double()
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
        lambda: m(q, words, chars)[0], loop, [q, words, chars, *m.parameters()]
    )


def test_hierarchical_loop_with_ragged_documents():
    torch.manual_seed(0)
    m = HierarchicalAttention(4, 5).double()
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

    assert_same_forward_backward(lambda: m(docs, mask).document, loop, [docs, *m.parameters()])


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
