"""The whole "is attention explanation?" suite on one set of examples (Jain & Wallace 2019;
Wiegreffe & Pinter 2019; Serrano & Smith 2019; Brauwers 4.2.2; Galassi VI), as
``attnkit explain`` runs it on a finished run.

A :class:`Probe` says how to run a classifier from its embedded inputs; :func:`explanation_suite`
returns plain numbers (JSON-ready) and a few examples for plots:

- ``agreement``: Kendall τ and top-k overlap between attention and each importance measure.
- ``rationale`` (with gold): the share of the gold items each ranking puts first
  (recall at |gold|), attention included.
- ``counterfactual``: output change under permuted and uniform weights, and the adversarial
  weights' divergence at output change < ε.
- ``erasure``: by each ordering, the share of examples whose decision flips before one item
  is left, and the fraction of the items removed when it does.
- ``confidence``: whether sharper attention goes with correct predictions.
- ``heads`` (models with :class:`attnkit.MultiHeadAttention`): importance by masking and the
  pruning curve.
- ``wiegreffe_pinter`` (``wp_steps`` > 0): the trained adversary's (λ = 0.01: KL is unbounded,
  and larger λ bought divergence with the predictions on the rationale task) divergence, output
  change and held-out agreement, and the held-out accuracy of the item-wise pooled MLP with uniform,
  learned, the model's and the adversary's weights frozen (:mod:`attnkit.evaluation.diagnostics`;
  even examples train, odd ones are held out; trained on the labels, else the predictions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit.evaluation import counterfactual as cf
from attnkit.evaluation import diagnostics as dg
from attnkit.evaluation import importance as imp
from attnkit.evaluation.agreement import kendall_tau, mean_defined, top_k_overlap
from attnkit.evaluation.confidence import attention_confidence, confidence_correlation
from attnkit.evaluation.erasure import erasure, random_order
from attnkit.evaluation.heads import head_importance_by_masking, heads_of, pruning_curve
from attnkit.evaluation.probe import Probe

__all__ = ["Probe", "explanation_suite", "rationale_recall"]


def rationale_recall(scores: Tensor, gold: Tensor, keep: Tensor) -> Tensor:
    """Per example, |top-|G| items by ``scores`` ∩ G| / |G| (G the gold items; recall at |G|,
    equal to precision at |G|); NaN for examples without gold. (B,)."""
    low = torch.tensor(-math.inf, dtype=torch.float64)
    s = torch.where(keep, scores.double(), low)
    rank = torch.sort(s, dim=-1, descending=True, stable=True).indices.argsort(-1)
    size = gold.sum(-1, keepdim=True)
    hit = (gold & (rank < size)).sum(-1).double()
    return torch.where(size.squeeze(-1) > 0, hit / size.squeeze(-1).clamp_min(1), math.nan)


def _clean(x: Any) -> Any:
    """JSON-ready: floats rounded to 6 digits, NaN as None."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, Tensor):
        return _clean(x.tolist())
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 6)
    return x


def explanation_suite(
    probe: Probe,
    *,
    epsilon: float = 0.01,
    n_permutations: int = 50,
    adversarial_steps: int = 150,
    ig_steps: int = 32,
    top_k: int = 3,
    n_plot: int = 4,
    seed: int = 0,
    wp_steps: int = 150,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every measure of the suite on the probe's examples; returns a JSON-ready dict (see the
    module docstring), plus ``examples``: the first ``n_plot`` examples' items, gold and scores
    by each measure, for plots.

    The output explained is the log-probability of the class predicted on the full input
    (Jain & Wallace's choice). Importance measures: ``gradient`` (norm), ``input_x_gradient``,
    ``integrated_gradients`` and ``leave_one_out`` (signed: positive supports the decision).
    ``progress``, when given, is called with a few words before each stage (the suite takes
    minutes on a few hundred examples).
    """
    say = progress or (lambda text: None)
    model, keep, x = probe.model, probe.keep, probe.inputs.detach()
    with torch.no_grad():
        full = probe.logits(x, keep)
    predicted = full.argmax(-1)

    def f(inputs: Tensor, keep: Tensor) -> Tensor:
        return probe.logits(inputs, keep).log_softmax(-1).gather(-1, predicted[:, None])[:, 0]

    say(f"importance by gradients, integrated gradients and leave-one-out ({x.shape[0]} examples)")
    measures = {
        "gradient": imp.gradient(f, x, keep),
        "input_x_gradient": imp.input_x_gradient(f, x, keep),
        "integrated_gradients": imp.integrated_gradients(f, x, keep, steps=ig_steps),
        "leave_one_out": imp.leave_one_out(f, x, keep),
    }
    attention = probe.attention.detach().to(x.dtype)
    out: dict[str, Any] = {"n_examples": int(x.shape[0]), "epsilon": epsilon}
    if probe.labels is not None:
        out["accuracy"] = float((predicted == probe.labels).double().mean())
    out["agreement"] = {
        name: {
            "kendall_tau": mean_defined(kendall_tau(attention, m, keep)),
            f"top_{top_k}_overlap": float(top_k_overlap(attention, m, top_k, keep).mean()),
        }
        for name, m in measures.items()
    }
    rankings = {"attention": attention, **measures}
    if probe.gold is not None:
        out["rationale"] = {
            name: mean_defined(rationale_recall(m, probe.gold, keep))
            for name, m in rankings.items()
        }

    def run() -> Tensor:
        return probe.logits(x, keep)

    say(
        f"counterfactual weights: {n_permutations} permutations, {adversarial_steps} steps of "
        "the adversary"
    )
    permuted = cf.permuted_weights(
        model, run, n_permutations=n_permutations, seed=seed, only=probe.attention_part
    )
    adversarial = cf.adversarial_weights(
        model, run, epsilon=epsilon, steps=adversarial_steps, only=probe.attention_part, seed=seed
    )
    out["counterfactual"] = {
        "permuted_median_output_change": float(permuted.median.mean()),
        "share_permutation_median_below_epsilon": float(
            (permuted.median < epsilon).double().mean()
        ),
        "uniform_output_change": float(cf.uniform_baseline(model, run).mean()),
        "adversarial_jsd": float(adversarial.divergence.mean()),
        "share_adversarial_jsd_above_half_max": float(
            (adversarial.divergence > 0.5 * math.log(2)).double().mean()
        ),
        "adversarial_max_output_change": float(adversarial.output_change.max()),
    }
    orders = {
        "attention": attention,
        "gradient": measures["gradient"],
        "leave_one_out": measures["leave_one_out"],
        "random": random_order(keep, seed),
    }
    say("erasure by each ordering")
    out["erasure"] = {}
    for name, order in orders.items():
        result = erasure(probe.logits, x, keep, order)
        flipped = result.flipped
        out["erasure"][name] = {
            "fraction_removed_when_flipped": (
                float(result.fraction[flipped].mean()) if bool(flipped.any()) else math.nan
            ),
            "share_flipped": float(flipped.double().mean()),
        }
    if probe.labels is not None:
        correct = predicted == probe.labels
        out["confidence"] = {
            name: confidence_correlation(signal, correct)
            for name, signal in attention_confidence(attention).items()
        }
    if heads_of(model):

        def accuracy() -> float:
            with torch.no_grad():
                logits = probe.logits(x, keep)
            target = probe.labels if probe.labels is not None else predicted
            return float((logits.argmax(-1) == target).double().mean())

        say("heads: importance by masking and the pruning curve")
        importance = head_importance_by_masking(model, accuracy)
        curve = pruning_curve(model, accuracy, importance)
        out["heads"] = {
            "importance": {k: v.tolist() for k, v in importance.items()},
            "pruning": {"fraction": curve.fraction, "metric": curve.metric},
        }
    if wp_steps > 0 and x.shape[0] >= 2:
        say(f"Wiegreffe & Pinter: a trained adversary and frozen-weights MLPs ({wp_steps} steps)")
        out["wiegreffe_pinter"] = _wiegreffe_pinter(probe, predicted, wp_steps, seed)
    examples = []
    for i in range(min(n_plot, x.shape[0])):
        n = int(keep[i].sum())
        idx = keep[i].nonzero().squeeze(-1)
        examples.append(
            {
                "tokens": (probe.tokens[i] if probe.tokens else [str(j) for j in range(n)]),
                "gold": None if probe.gold is None else probe.gold[i, idx].tolist(),
                "predicted": int(predicted[i]),
                "label": None if probe.labels is None else int(probe.labels[i]),
                "scores": {k: v[i, idx].tolist() for k, v in rankings.items()},
                "adversarial": adversarial.weights[i].reshape(-1, keep.shape[1])[0, idx].tolist(),
            }
        )
    out["examples"] = examples
    return _clean(out)


def _wiegreffe_pinter(probe: Probe, predicted: Tensor, steps: int, seed: int) -> dict[str, Any]:
    train = torch.arange(predicted.shape[0], device=predicted.device) % 2 == 0
    adversary = dg.train_adversary(probe, train=train, lam=0.01, steps=steps, lr=1e-3)
    held_out = ~train
    keep, n = probe.keep, probe.keep.shape[-1]
    labels = probe.labels if probe.labels is not None else predicted
    pooling = {
        "uniform": dg.uniform_pooling(keep),
        "learned": "learned",
        "model": probe.attention.detach().reshape(keep.shape[0], -1, n)[:, 0],
        "adversary": adversary.weights.reshape(keep.shape[0], -1, n)[:, 0],
    }
    return {
        "adversary_jsd": float(adversary.divergence[held_out].mean()),
        "adversary_output_change": float(adversary.output_change[held_out].mean()),
        "adversary_agreement": adversary.agreement,
        "frozen_mlp_accuracy": dg.frozen_weights_probe(
            probe.inputs, keep, labels, pooling, train=train, steps=steps, seed=seed
        ),
    }
