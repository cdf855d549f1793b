"""End-to-end memory network against loops written from Sukhbaatar et al. (2015): eqs. 1-4, the
position encoding of Sec. 4.1, temporal encoding, and the two weight-tying schemes of Sec. 2.2."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.memory import EndToEndMemoryNetwork, position_encoding


def _pe_loop(big_j: int, max_len: int, d: int) -> list[list[float]]:
    """l_kj = (1 − j/J) − (k/d)(1 − 2j/J), j and k counted from 1; zero past the sentence."""
    rows = []
    for j in range(1, max_len + 1):
        if j > big_j:
            rows.append([0.0] * d)
        else:
            rows.append([(1 - j / big_j) - (k / d) * (1 - 2 * j / big_j) for k in range(1, d + 1)])
    return rows


def test_position_encoding_matches_the_formula():
    lengths = torch.tensor([1, 3, 5, 0])
    got = position_encoding(lengths, 5, 4).double()
    for b, big_j in enumerate(lengths.tolist()):
        ref = torch.tensor(_pe_loop(big_j, 5, 4), dtype=torch.float64)
        torch.testing.assert_close(got[b], ref, atol=1e-6, rtol=0)


def _reference(model, story, query, mask, query_mask):
    """The forward pass from the paper, one example and one memory at a time, with the tied
    matrices written out per scheme (A^k, C^k, B, W, H, T_A^k, T_C^k)."""
    hops, tying, d = model.hops, model.tying, model.embed_dim
    e = [t.detach() for t in model.embeddings]
    tt = None if model.temporal is None else [t.detach() for t in model.temporal]
    if tying == "adjacent":  # A^{k+1} = C^k, B = A^1, W = C^K (Sec. 2.2)
        a = [e[k] for k in range(hops)]
        c = [e[k + 1] for k in range(hops)]
        b_table, w = e[0], e[hops]
        ta = None if tt is None else [tt[k] for k in range(hops)]
        tc = None if tt is None else [tt[k + 1] for k in range(hops)]
        h = None
    else:  # layer-wise: A^1 = A^2 = …, C^1 = C^2 = …, u^{k+1} = H u^k + o^k
        a, c = [e[0]] * hops, [e[1]] * hops
        b_table, w, h = model.query_embedding.detach(), model.W.weight.detach(), model.H.weight
        h = h.detach()
        ta = None if tt is None else [tt[0]] * hops
        tc = None if tt is None else [tt[1]] * hops

    def encode(words, word_mask, table):
        real = [j for j in range(len(words)) if word_mask[j]]
        big_j = len(real)
        out = torch.zeros(d, dtype=torch.float64)
        for j in real:  # real words come first (left-aligned)
            vec = words[j] @ table if words.is_floating_point() else table[words[j]]
            for k in range(d):
                weight = (
                    (1 - (j + 1) / big_j) - ((k + 1) / d) * (1 - 2 * (j + 1) / big_j)
                    if model.position_encoding
                    else 1.0
                )
                out[k] += weight * vec[k]
        return out

    logits = []
    for bi in range(story.shape[0]):
        sentences = [i for i in range(story.shape[1]) if mask[bi, i].any()]
        u = encode(query[bi], query_mask[bi], b_table)
        for k in range(hops):
            m, cc = [], []
            for i in sentences:
                back = len(sentences) - 1 - i  # reverse order: the last sentence is i = 0
                m.append(
                    encode(story[bi, i], mask[bi, i], a[k]) + (0 if ta is None else ta[k][back])
                )
                cc.append(
                    encode(story[bi, i], mask[bi, i], c[k]) + (0 if tc is None else tc[k][back])
                )
            scores = [float(u @ mi) for mi in m]
            top = max(scores)
            z = sum(math.exp(s - top) for s in scores)
            p = [math.exp(s - top) / z for s in scores]  # eq. 1
            o = sum(pi * ci for pi, ci in zip(p, cc, strict=True))  # eq. 2
            u = (u if h is None else h @ u) + o  # eq. 4
        logits.append(w @ u)  # eq. 3
    return torch.stack(logits)


@pytest.mark.parametrize("tying", ["adjacent", "layer_wise"])
@pytest.mark.parametrize("pe", [True, False])
@pytest.mark.parametrize("ids", [True, False])
def test_forward_matches_the_paper_loop(tying, pe, ids):
    torch.manual_seed(0)
    model = EndToEndMemoryNetwork(
        7, 5, hops=3, tying=tying, position_encoding=pe, max_memories=6
    ).double()
    g = torch.Generator().manual_seed(1)
    if ids:
        story, query = (
            torch.randint(1, 7, (2, 4, 3), generator=g),
            torch.randint(1, 7, (2, 3), generator=g),
        )
    else:
        story = torch.randn(2, 4, 3, 7, generator=g, dtype=torch.float64)
        query = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 4, 3, dtype=torch.bool)
    mask[0, 3] = False  # item 0 has 3 sentences
    mask[1, :, 2] = False  # item 1 has sentences of 2 words
    query_mask = torch.tensor([[True, True, True], [True, True, False]])
    got = model(story, query, mask=mask, query_mask=query_mask).logits
    torch.testing.assert_close(got, _reference(model, story, query, mask, query_mask))


def test_ids_and_one_hot_words_agree():
    torch.manual_seed(0)
    model = EndToEndMemoryNetwork(6, 4, hops=2, max_memories=5).double()
    story, query = torch.randint(0, 6, (3, 5, 4)), torch.randint(0, 6, (3, 2))
    by_id = model(story, query)
    one_hot = model(
        torch.nn.functional.one_hot(story, 6).double(),
        torch.nn.functional.one_hot(query, 6).double(),
    )
    torch.testing.assert_close(by_id.logits, one_hot.logits)
    torch.testing.assert_close(by_id.weights, one_hot.weights)


def test_adjacent_tying_shares_the_parameters():
    """A^{k+1} = C^k, B = A^1, W = C^K as parameter identity: K + 1 tables, nothing else."""
    model = EndToEndMemoryNetwork(6, 4, hops=3, max_memories=5)
    for k in range(2):
        assert model.embeddings[model.input_table(k + 1)] is model.embeddings[model.output_table(k)]
    assert model.query_table() is model.embeddings[model.input_table(0)]
    assert model.answer_table() is model.embeddings[model.output_table(2)]
    assert len(list(model.parameters())) == 2 * 4  # K + 1 embeddings and K + 1 temporal tables
    # and a gradient on the shared C^1 = A^2 sums both roles
    story, query = torch.randint(0, 6, (2, 3, 2)), torch.randint(0, 6, (2, 2))
    model(story, query).logits.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_layer_wise_tying_shares_the_parameters():
    model = EndToEndMemoryNetwork(6, 4, hops=3, tying="layer_wise")
    assert {model.input_table(k) for k in range(3)} == {0}
    assert {model.output_table(k) for k in range(3)} == {1}
    assert model.query_table() is model.query_embedding
    assert model.answer_table() is model.W.weight
    names = {n for n, _ in model.named_parameters()}
    assert names == {"embeddings.0", "embeddings.1", "query_embedding", "H.weight", "W.weight"}


def test_one_hop_with_a_equal_to_c_is_dot_attention_on_the_embedded_memories():
    """With A = C, one hop is ak.attention(u, m, m) with a dot score, plus the residual u."""
    torch.manual_seed(0)
    model = EndToEndMemoryNetwork(8, 6, hops=1, tying="layer_wise", position_encoding=False)
    with torch.no_grad():
        model.embeddings[1].copy_(model.embeddings[0])
        model.H.weight.copy_(torch.eye(6))
    story, query = torch.randint(0, 8, (2, 5, 3)), torch.randint(0, 8, (2, 2))
    m = model.embeddings[0][story].sum(-2)  # bag of words
    u = model.query_embedding[query].sum(-2)
    ref = ak.attention(u[:, None], m, m, score="dot", need_weights=True)
    out = model(story, query)
    torch.testing.assert_close(out.weights[:, 0], ref.weights[:, 0])
    torch.testing.assert_close(out.state, u + ref.context[:, 0])


def test_linear_start_uses_the_scores_as_weights_until_the_softmax_is_reinserted():
    """Sec. 4.2: p_i = uᵀ m_i while linear start lasts (padded memories 0); the rule re-inserts
    the softmax once the validation loss does not decrease; the state is in the state dict."""
    torch.manual_seed(0)
    kw = {"hops": 2, "position_encoding": False}
    model = EndToEndMemoryNetwork(8, 6, linear_start=True, **kw).double()
    plain = EndToEndMemoryNetwork(8, 6, **kw).double()
    params = {k: v for k, v in model.state_dict().items() if not k.startswith("linear")}
    plain.load_state_dict(params, strict=False)  # the same weights, softmax hops
    story, query = torch.randint(1, 8, (2, 4, 3)), torch.randint(1, 8, (2, 2))
    mask = torch.ones(2, 4, 3, dtype=torch.bool)
    mask[1, 3] = False  # the second story has 3 sentences
    out = model(story, query, mask=mask)
    a = model.embeddings[0].detach()  # A^1 = B under adjacent tying
    for b in range(2):
        u = sum(a[w] for w in query[b].tolist())
        for i in range(4):
            m = sum(a[w] for w in story[b, i].tolist())
            expected = float(u @ m) if mask[b, i].any() else 0.0
            assert float(out.weights[b, 0, i].detach()) == pytest.approx(
                expected, rel=1e-12, abs=1e-12
            )
    assert model.linear_start_active and not plain.linear_start_active
    assert not torch.allclose(out.logits, plain(story, query, mask=mask).logits)
    assert model.linear_start_step(2.0) is False  # improved on inf: goes on
    assert model.linear_start_step(1.5) is False
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.linear_start_step(1.5) is True  # not below the best: softmax back
    assert not model.linear_start_active and model.linear_start_step(0.1) is False
    torch.testing.assert_close(
        model(story, query, mask=mask).logits, plain(story, query, mask=mask).logits
    )
    resumed = EndToEndMemoryNetwork(8, 6, hops=2).double()
    resumed.load_state_dict(state)  # a checkpoint taken during linear start
    assert resumed.linear_start_active and float(resumed.linear_best) == 1.5


def test_temporal_encoding_counts_back_from_the_last_real_sentence():
    """Without words to tell them apart, only T_A(i), T_C(i) distinguish memories: padding a
    story at its end leaves every real memory with the same index, hence the same output."""
    torch.manual_seed(0)
    model = EndToEndMemoryNetwork(5, 4, hops=1, max_memories=6).double()
    story = torch.ones(1, 3, 2, dtype=torch.long)
    query = torch.ones(1, 2, dtype=torch.long)
    short = model(story, query)
    padded_story = torch.cat([story, torch.zeros(1, 2, 2, dtype=torch.long)], 1)
    mask = torch.tensor([[True, True]] * 3 + [[False, False]] * 2)[None]
    long = model(padded_story, query, mask=mask)
    torch.testing.assert_close(long.logits, short.logits)
    torch.testing.assert_close(long.weights[..., :3], short.weights)
    # identical sentences get different weights only through time
    assert not torch.allclose(short.weights[0, 0, 0], short.weights[0, 0, 1])


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="tying must be"):
        EndToEndMemoryNetwork(5, 4, tying="rnn")
    with pytest.raises(ValueError, match="n_answers = 3 but adjacent tying"):
        EndToEndMemoryNetwork(5, 4, n_answers=3)
    model = EndToEndMemoryNetwork(5, 4, max_memories=2)
    with pytest.raises(ValueError, match="story has word ids outside"):
        model(torch.full((1, 2, 2), 5), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"story has 3 sentences.*max_memories = 2"):
        model(torch.zeros(1, 3, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"story has 4 features.*vocab_size = 5"):
        model(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match="query has batch size 2"):
        model(torch.zeros(1, 2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="mask of shape"):
        model(
            torch.zeros(1, 2, 2, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.long),
            mask=torch.ones(1, 2, dtype=torch.bool),
        )
    with pytest.raises(TypeError, match="score must be an attnkit Score"):
        EndToEndMemoryNetwork(5, 4, score="dot")
