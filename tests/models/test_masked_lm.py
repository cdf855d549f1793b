"""The BERT-style masked LM: masking proportions (15%, then 80/10/10) on a large sample within
4 standard errors, labels and the loss against a loop, bidirectional reading and padding."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.models.masked_lm import IGNORE, MaskedLM, mask_tokens, masked_lm_loss


def _within(share, target, n):
    se = math.sqrt(target * (1 - target) / n)
    assert abs(share - target) < 4 * se, (share, target, se)


def test_masking_proportions_on_a_large_sample():
    g = torch.Generator().manual_seed(0)
    vocab, mask_id = 20, 20
    tokens = torch.randint(0, vocab, (400, 500), generator=g)
    keep = torch.ones_like(tokens, dtype=torch.bool)
    keep[:, 0] = False  # e.g. a class token: never chosen
    out = mask_tokens(tokens, vocab_size=vocab, mask_id=mask_id, keep=keep, generator=g)
    assert not out.chosen[:, 0].any()
    n_eligible = int(keep.sum())
    _within(out.chosen.sum().item() / n_eligible, 0.15, n_eligible)
    c = out.chosen
    n = int(c.sum())
    masked = (out.inputs[c] == mask_id).float().mean().item()
    kept = (out.inputs[c] == tokens[c]).float().mean().item()
    other = ((out.inputs[c] != mask_id) & (out.inputs[c] != tokens[c])).float().mean().item()
    _within(masked, 0.8, n)
    _within(kept, 0.1 + 0.1 / vocab, n)  # a random draw hits the original with chance 1/V
    _within(other, 0.1 * (1 - 1 / vocab), n)
    assert torch.equal(out.inputs[~c], tokens[~c])  # positions not chosen are untouched
    assert torch.equal(out.labels[c], tokens[c]) and (out.labels[~c] == IGNORE).all()


def test_loss_is_cross_entropy_over_the_chosen_positions():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    labels = torch.tensor([[IGNORE, 3, IGNORE, 0], [5, IGNORE, IGNORE, IGNORE]])
    terms = []
    for b in range(2):
        for i in range(4):
            if labels[b, i] != IGNORE:
                row = logits[b, i]
                terms.append(torch.logsumexp(row, 0) - row[labels[b, i]])
    torch.testing.assert_close(masked_lm_loss(logits, labels), sum(terms) / len(terms))
    assert masked_lm_loss(logits, torch.full_like(labels, IGNORE)).item() == 0.0


def test_reads_both_directions_and_padding_changes_nothing():
    torch.manual_seed(0)
    model = MaskedLM(12, 8, embed_dim=16, num_heads=2, layers=1, dtype=torch.float64).eval()
    tokens = torch.randint(0, 12, (2, 6))
    emb = model.embed(tokens).detach().requires_grad_()
    pos = model.pos(torch.arange(6))
    h = model.norm(model.encoder(emb + pos)) @ model.embed.weight.T
    h[:, 0].sum().backward()
    assert emb.grad[:, 5].abs().sum() > 0  # position 0 reads the last token
    lengths = torch.tensor([6, 4])
    mask = ak.masks.from_lengths(lengths, 6)
    padded = model(tokens, mask)
    alone = model(tokens[1:, :4])
    torch.testing.assert_close(padded[1, :4], alone[0])


def test_errors():
    with pytest.raises(TypeError, match="integer"):
        mask_tokens(torch.randn(2, 3), vocab_size=5, mask_id=4)
    with pytest.raises(ValueError, match="keep"):
        mask_tokens(
            torch.zeros(2, 3, dtype=torch.long),
            vocab_size=5,
            mask_id=4,
            keep=torch.ones(2, 4, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="max_len"):
        MaskedLM(5, 4, embed_dim=8, num_heads=2, layers=1)(torch.zeros(1, 6, dtype=torch.long))


@pytest.mark.slow
def test_learns_to_fill_in_a_counting_sequence():
    """Sequences s, s+1, …, s+9 (mod 10) under BERT masking: a hidden token is a neighbour ± 1,
    read from either side. Bar: ≥ 0.9 of the [MASK]ed tokens right (chance 0.1) after 800
    steps (about 0.96 at 600 steps, 0.99 at 800 when measured)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = MaskedLM(11, 10, embed_dim=32, num_heads=2, layers=2, d_ff=64, norm_first=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(n):
        start = torch.randint(0, 10, (n, 1), generator=g)
        return (start + torch.arange(10)) % 10

    for _ in range(800):
        m = mask_tokens(batch(64), vocab_size=10, mask_id=10, generator=g)
        loss = masked_lm_loss(model(m.inputs), m.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m = mask_tokens(batch(512), vocab_size=10, mask_id=10, generator=g)
    with torch.no_grad():
        guess = model.eval()(m.inputs).argmax(-1)
    hidden = m.chosen & (m.inputs == 10)
    assert (guess[hidden] == m.labels[hidden]).float().mean().item() >= 0.9
