"""Preliminary training: frozen energies stay fixed through training, EnergyAttention is
align-then-average against a direct computation, and energies learned on one task let a new
model learn another task from a few steps, where the same model with its own energies lags."""

import pytest
import torch
from torch import nn

from attnkit.evaluation import capture
from attnkit.training.pretrained_energies import EnergyAttention, PretrainedEnergies, freeze
from attnkit.training.synthetic import signal_sequences

VOCAB, LENGTH, CLASSES, D = 32, 16, 4, 16


class _Scorer(nn.Module):
    """One energy per token (as a relevance or reading-time predictor)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.w = nn.Embedding(VOCAB, D), nn.Linear(D, 1)

    def forward(self, tokens):
        return self.w(torch.tanh(self.embed(tokens))).squeeze(-1)


class _Classifier(nn.Module):
    def __init__(self, energies: nn.Module, classes: int) -> None:
        super().__init__()
        self.values, self.out = nn.Embedding(VOCAB, D), nn.Linear(D, classes)
        self.attention = EnergyAttention(energies)

    def forward(self, tokens):
        return self.out(self.attention(tokens, self.values(tokens)).context.squeeze(-2))


def _train(model, tokens, labels, steps, seed):
    optimiser = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.03)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        i = torch.randint(0, len(labels), (32,), generator=g)
        loss = nn.functional.cross_entropy(model(tokens[i]), labels[i])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model


def _accuracy(model, tokens, labels):
    with torch.no_grad():
        return float((model(tokens).argmax(-1) == labels).float().mean())


def test_frozen_energies_do_not_change_and_stay_in_eval_mode():
    scorer = nn.Sequential(nn.Embedding(VOCAB, D), nn.Dropout(0.5), nn.Linear(D, 1), nn.Flatten(-2))
    energies = PretrainedEnergies(scorer)
    model = _Classifier(energies, 2).train()
    assert not scorer.training and not any(p.requires_grad for p in scorer.parameters())
    before = [p.clone() for p in scorer.parameters()]
    tokens = torch.randint(0, VOCAB, (8, LENGTH))
    _train(model, tokens, torch.randint(0, 2, (8,)), steps=3, seed=0)
    for p, q in zip(scorer.parameters(), before, strict=True):
        torch.testing.assert_close(p, q)
    e1, e2 = energies(tokens), energies(tokens)  # no dropout: a fixed function
    torch.testing.assert_close(e1, e2)
    assert e1.grad_fn is None
    assert freeze(nn.Linear(2, 2)).weight.requires_grad is False


def test_energy_attention_against_a_direct_computation():
    torch.manual_seed(0)
    scorer = _Scorer()
    attention = EnergyAttention(scorer)
    tokens, values = torch.randint(0, VOCAB, (3, 5)), torch.randn(3, 5, 4)
    mask = torch.tensor([True, True, False, True, True]).expand(3, 5)
    with capture(attention) as records:
        out = attention(tokens, values, mask=mask)
    e = scorer(tokens).masked_fill(~mask, float("-inf"))
    a = e.softmax(-1)
    torch.testing.assert_close(out.weights.squeeze(-2), a)
    torch.testing.assert_close(out.context.squeeze(-2), (a.unsqueeze(-1) * values).sum(-2))
    torch.testing.assert_close(records["EnergyAttention"][0], out.weights.detach())
    with pytest.raises(ValueError, match="disagree on N"):
        attention(tokens, torch.randn(3, 6, 4))
    with pytest.raises(TypeError, match=r"energies must be an nn\.Module"):
        EnergyAttention(lambda x: x)


def test_pretrained_energies_let_another_model_learn_faster():
    g = torch.Generator().manual_seed(0)
    source = signal_sequences(1024, LENGTH, vocab=VOCAB, classes=CLASSES, generator=g)
    target = signal_sequences(1024, LENGTH, vocab=VOCAB, classes=CLASSES, generator=g)
    test = signal_sequences(512, LENGTH, vocab=VOCAB, classes=CLASSES, generator=g)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        first = _train(_Classifier(_Scorer(), CLASSES), source.tokens, source.label, 150, 0)
        # another architecture and task (the signal's parity): new values and output layer
        pretrained = _Classifier(PretrainedEnergies(first.attention.energies), 2)
        torch.manual_seed(1)
        scratch = _Classifier(_Scorer(), 2)
    assert _accuracy(first, test.tokens, test.label) > 0.95
    parity, test_parity = target.label % 2, test.label % 2
    _train(pretrained, target.tokens, parity, 10, 1)
    _train(scratch, target.tokens, parity, 10, 1)
    fast = _accuracy(pretrained, test.tokens, test_parity)
    slow = _accuracy(scratch, test.tokens, test_parity)
    assert fast > 0.95 and fast > slow + 0.15, (fast, slow)
    # the fixed energies put the weight on the signal token
    with torch.no_grad():
        w = pretrained.attention(test.tokens, pretrained.values(test.tokens)).weights
    assert float(w.squeeze(-2)[torch.arange(512), test.position].mean()) > 0.9
