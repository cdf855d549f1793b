"""The explanation suite: recall of the gold rationale by hand, and the whole suite on small
models built from attnkit parts (one learned-query attention; multi-head self-attention)."""

import json
import math

import pytest
import torch
from toy_models import pooled

import attnkit as ak
from attnkit.evaluation import capture
from attnkit.evaluation.suite import Probe, explanation_suite, rationale_recall


def test_rationale_recall_by_hand():
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.9], [0.4, 0.3, 0.2, 0.1], [1.0, 0.0, 0.0, 0.0]])
    gold = torch.tensor(
        [[False, True, True, False], [True, False, False, False], [False, False, False, False]]
    )
    keep = torch.tensor([[True] * 4, [False, True, True, True], [True] * 4])
    got = rationale_recall(scores, gold, keep)
    # row 0: top-2 = {3, 1}, one of the two gold; row 1: item 0 is not kept, so never ranked
    assert got[:2].tolist() == [0.5, 0.0] and math.isnan(float(got[2]))


def small_probe(model, x, keep, gold=None, labels=None):
    with torch.no_grad(), capture(model) as records:
        model(x, keep)
    return Probe(
        model=model,
        logits=model,
        inputs=x,
        keep=keep,
        attention=records["attention"][0][:, 0],
        labels=labels,
        gold=gold,
    )


def test_suite_on_a_learned_query_model():
    model = pooled(seed=5)
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    keep = torch.ones(6, 5, dtype=torch.bool)
    keep[0, 3:] = False
    gold = torch.zeros(6, 5, dtype=torch.bool)
    gold[:, 1] = True
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    probe = small_probe(model, x, keep, gold, labels)
    out = explanation_suite(probe, n_permutations=5, adversarial_steps=10, ig_steps=4, n_plot=2)
    json.dumps(out)  # JSON-ready
    assert set(out) >= {"agreement", "rationale", "counterfactual", "erasure", "confidence"}
    assert "heads" not in out
    wp = out["wiegreffe_pinter"]
    assert set(wp["frozen_mlp_accuracy"]) == {"uniform", "learned", "model", "adversary"}
    assert 0 <= wp["adversary_jsd"] <= math.log(2) and 0 <= wp["adversary_agreement"] <= 1
    assert out["counterfactual"]["adversarial_max_output_change"] < 0.01
    expected = float((model(x, keep).argmax(-1) == labels).double().mean())
    assert out["accuracy"] == pytest.approx(expected)
    for v in out["agreement"].values():
        assert -1 <= v["kendall_tau"] <= 1 and 0 <= v["top_3_overlap"] <= 1
    assert len(out["examples"]) == 2 and len(out["examples"][0]["tokens"]) == 3
    assert out["examples"][0]["scores"]["attention"] == pytest.approx(
        probe.attention[0, :3].tolist(), abs=1e-6
    )  # rounded to 6 digits


class HeadsClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = ak.MultiHeadAttention(4, 2)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, x, keep):
        h = self.mha(x, mask=keep.unsqueeze(1)).context
        pooled = (h * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True)
        return self.out(pooled)


def test_suite_on_multihead_self_attention_reports_heads():
    torch.manual_seed(0)
    model = HeadsClassifier().double().eval()
    x = torch.randn(4, 5, 4, dtype=torch.float64)
    keep = torch.ones(4, 5, dtype=torch.bool)
    with torch.no_grad(), capture(model) as records:
        model(x, keep)
    attention = records["mha.attention"][0].mean((1, 2))  # over heads and query rows
    probe = Probe(model, model, x, keep, attention, labels=torch.tensor([0, 1, 2, 0]))
    out = explanation_suite(probe, n_permutations=3, adversarial_steps=5, ig_steps=2, n_plot=1)
    assert set(out["heads"]["importance"]) == {"mha"}
    assert len(out["heads"]["pruning"]["metric"]) == 2  # all heads, then one removed
    assert out["heads"]["pruning"]["metric"][0] == out["accuracy"]
