"""Attention alignment across domains: Kang et al.'s distance against a loop, and transfer: with
16 labelled target-domain sequences, a target model that aligns its attention with the
source-domain model's on paired inputs tags far better than one trained on the labels alone."""

import math

import pytest
import torch
from parent_tagger import VOCAB, Tagger, accuracy, parent_class, tag_loss

from attnkit.evaluation import supervised_attention_loss
from attnkit.training.domain_alignment import align_attention, attention_alignment_loss


def test_l2_of_normalised_rows_against_a_loop():
    torch.manual_seed(0)
    t = torch.randn(2, 3, 4, dtype=torch.float64).softmax(-1)
    s = torch.randn(2, 3, 4, dtype=torch.float64).softmax(-1)
    rows = []
    for b in range(2):
        for i in range(3):
            nt = math.sqrt(sum(float(t[b, i, j]) ** 2 for j in range(4)))
            ns = math.sqrt(sum(float(s[b, i, j]) ** 2 for j in range(4)))
            d = sum((float(t[b, i, j]) / nt - float(s[b, i, j]) / ns) ** 2 for j in range(4))
            rows.append(math.sqrt(d))
    assert float(attention_alignment_loss(t, s)) == pytest.approx(sum(rows) / 6)
    # a map and its multiple are the same attention pattern
    assert float(attention_alignment_loss(2 * s, s)) == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(
        attention_alignment_loss(t, s, kind="kl"), supervised_attention_loss(t, s)
    )


def test_rows_without_source_mass_do_not_count_and_source_is_fixed():
    t = torch.tensor([[0.5, 0.5], [0.2, 0.8]], requires_grad=True)
    s = torch.tensor([[1.0, 0.0], [0.0, 0.0]], requires_grad=True)
    loss = attention_alignment_loss(t, s)
    assert float(loss.detach()) == pytest.approx(math.sqrt((0.5**0.5 - 1) ** 2 + 0.5))
    loss.backward()
    assert s.grad is None and t.grad[1].abs().sum() == 0
    with pytest.raises(ValueError, match="kind must be 'l2' or 'kl'"):
        attention_alignment_loss(t, s, kind="cos")
    with pytest.raises(ValueError, match="must have one shape"):
        attention_alignment_loss(t, s[:1])


def _train_target(source, train, align: bool) -> Tagger:
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))  # the target domain
    labels, few = parent_class(train), torch.arange(16)
    g = torch.Generator().manual_seed(2)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        target = Tagger()
    optimiser = torch.optim.Adam(target.parameters(), lr=0.03)
    for _ in range(60):
        if align:  # the 16 labelled sequences and 16 unlabelled pairs
            i = torch.cat([few, torch.randint(16, len(train.tokens), (16,), generator=g)])
            source_tokens = train.tokens[i]
            logits, aligned = align_attention(target, source, perm[source_tokens], source_tokens)
            loss = tag_loss(logits[:16], labels[few]) + 10.0 * aligned
        else:
            loss = tag_loss(target(perm[train.tokens[few]]), labels[few])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return target.eval(), perm


def test_aligned_attention_transfers_to_the_target_domain(lisa_tagger):
    source, train, test = lisa_tagger.model, lisa_tagger.train, lisa_tagger.test
    scores = {}
    for align in (False, True):
        target, perm = _train_target(source, train, align)
        with torch.no_grad():
            scores[align] = accuracy(target(perm[test.tokens]), parent_class(test))
    assert scores[True] > 0.8, scores
    assert scores[True] > scores[False] + 0.2, scores
