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


def _replay_local_m(m, src, tgt, window):
    """The decoder written out by hand with local-m attention (Brauwers eq. 27, p_t = t)."""
    states, h = m.encode(src)
    score = m.attention.module.score
    context = states.new_zeros(states.shape[0], states.shape[-1])
    weights = []
    for t in range(tgt.shape[1]):
        h = m.cell(torch.cat([m.embed_out(tgt[:, t]), context], -1), h)
        e = score(h.unsqueeze(-2), states).squeeze(-2)  # (B, N)
        rows = []
        for b in range(e.shape[0]):
            inside = [abs(j - t) <= window for j in range(e.shape[1])]
            denom = sum(torch.exp(e[b, j]) for j in range(e.shape[1]) if inside[j])
            rows.append(
                torch.stack(
                    [torch.exp(e[b, j]) / denom if inside[j] else e[b, j] * 0 for j in range(6)]
                )
            )
        a = torch.stack(rows)
        context = (a.unsqueeze(-1) * states).sum(1)
        weights.append(a)
    return torch.stack(weights, 1)


def test_local_monotonic_follows_the_decoder_step():
    torch.manual_seed(0)
    align = ak.alignments.Local(1, "monotonic")
    m = Seq2SeqAttention(10, 12, 8, ak.Attention(ak.scores.Additive(8, 16, 8), align))
    m = m.double().eval()
    src = torch.randint(1, 10, (2, 6))
    tgt = torch.randint(0, 12, (2, 5))
    out = m(src, tgt)
    for t in range(5):
        outside = [j for j in range(6) if abs(j - t) > 1]
        assert (out.weights[:, t, outside] == 0).all(), f"step {t} attends outside [t-1, t+1]"
    torch.testing.assert_close(out.weights, _replay_local_m(m, src, tgt, 1))


def test_local_monotonic_decoder_reports_weights_to_the_hook():
    m = Seq2SeqAttention(
        10, 12, 8, ak.Attention(ak.scores.Additive(8, 16, 8), ak.alignments.Local(1))
    )
    with ak.hooks.listen() as reports:
        m(torch.randint(1, 10, (1, 4)), torch.randint(0, 12, (1, 3)))
    assert len(reports) == 3 and reports[2].weights[0, 0, 0] == 0


def test_built_in_float64_runs_in_float64_and_accepts_from_lengths_masks():
    torch.manual_seed(0)
    kw = {"dtype": torch.float64}
    m = Seq2SeqAttention(10, 12, 8, ak.Attention(ak.scores.Additive(8, 16, 8, **kw)), **kw)
    assert {p.dtype for p in m.parameters()} == {torch.float64}
    src, tgt = torch.randint(1, 10, (2, 5)), torch.randint(0, 12, (2, 3))
    mask = ak.masks.from_lengths(torch.tensor([5, 3]), 5)  # (B, 1, N)
    out = m(src, tgt, mask)
    assert out.logits.dtype == torch.float64
    assert (out.weights[1, :, 3:] == 0).all()
    torch.testing.assert_close(out.logits, m(src, tgt, mask.squeeze(1)).logits)
