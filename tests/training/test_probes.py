"""Clark et al.'s attention-only probe: features against a loop, and a relation planted in one
head of a random encoder is recovered (by that head's coefficients), while the same probe on
the encoder without the plant is near chance."""

import pytest
import torch

from attnkit.evaluation import capture
from attnkit.training.probes import (
    AttentionProbe,
    fit_probe,
    pair_features,
    probe_accuracy,
    stack_heads,
)
from attnkit.training.synthetic import parent_sequences
from attnkit.transformer import TransformerEncoder


def test_pair_features_against_a_loop():
    w = torch.rand(2, 3, 4, 4)
    f = pair_features(w)
    assert f.shape == (2, 4, 4, 6)
    for b in range(2):
        for i in range(4):
            for j in range(4):
                expected = [float(w[b, k, i, j]) for k in range(3)]
                expected += [float(w[b, k, j, i]) for k in range(3)]
                assert f[b, i, j].tolist() == pytest.approx(expected)


def test_stack_heads_and_errors():
    a, b = torch.rand(2, 2, 3, 3), torch.rand(2, 3, 3, 3)
    torch.testing.assert_close(stack_heads({"x": [a], "y": [b]}), torch.cat([a, b], 1))
    with pytest.raises(ValueError, match="non-empty mapping"):
        stack_heads({})
    with pytest.raises(ValueError, match=r"records\['x'\] must hold self-attention weights"):
        stack_heads({"x": [torch.rand(2, 2, 3, 4)]})
    with pytest.raises(ValueError, match=r"weights must be \(B, K, N, N\)"):
        pair_features(torch.rand(2, 2, 3, 4))


def test_probe_masks_candidates_and_checks_targets():
    probe = AttentionProbe(2)
    f = torch.rand(1, 3, 3, 2)
    mask = torch.tensor([[True, False, False], [True, False, False], [False, False, False]])
    log_p = probe(f, mask)
    assert log_p[0, 0].tolist() == [0.0, float("-inf"), float("-inf")]
    assert log_p[0, 2].isneginf().all()
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        fit_probe(f, torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"targets must be token indices in \[0, 3\)"):
        fit_probe(f, torch.full((1, 3), 3))
    with pytest.raises(ValueError, match="nothing to fit"):
        fit_probe(f, torch.full((1, 3), -1))


def test_probe_recovers_a_relation_planted_in_one_head():
    task = parent_sequences(256, 8, generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        encoder, embed = TransformerEncoder(2, 16, 4, 32).eval(), torch.nn.Embedding(12, 16)
    parents = torch.nn.functional.one_hot(task.parents.clamp_min(0), 8).bool()
    parents &= (task.parents >= 0)[..., None]

    def plant(e, b, h, q, kv):  # head 2 of every layer leans towards each token's parent
        return e + 3.0 * ((h == 2) & parents[b, q, kv])

    train, test = slice(0, 128), slice(128, 256)
    found = {}
    for planted in (True, False):
        with torch.no_grad(), capture(encoder) as records:
            encoder(embed(task.tokens), score_mod=plant if planted else None)
        features = pair_features(stack_heads(records))  # K = 8 heads: a_ij 0-7, a_ji 8-15
        probe = fit_probe(features[train], task.parents[train], steps=100)
        found[planted] = probe_accuracy(probe, features[test], task.parents[test])
        if planted:
            top = probe.coefficients.weight[0].topk(2).indices
            assert set(top.tolist()) == {2, 6}  # head 2 of layers 0 and 1, a_ij
    assert found[True] > 0.95, found
    assert found[False] < 0.5, found
