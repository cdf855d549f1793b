"""The digits task's ViT option: the task builds it on ``attention=vit``, and its reported
weights are the class token's last-layer attention over the patches (mean over heads,
renormalised), read independently from the last layer's multi-head attention."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.digits_task import GRID, RAM_GRID, DigitsModel, DigitsRAM, DigitsViT


def test_the_task_builds_a_vit_on_request():
    base = dict(task="digits", n_train=8, n_test=4, epochs=1, batch_size=4, d_model=16)
    config = RunConfig(**base, attention="vit", score="scaled_dot", align="sparsemax")
    vit = tasks.get("digits")(config.resolved()).build_model()
    assert isinstance(vit, DigitsViT)
    mha = vit.vit.encoder.layers[0].self_attention.module
    assert type(mha.score).__name__ == "ScaledDot" and type(mha.align).__name__ == "Sparsemax"
    default = tasks.get("digits")(RunConfig(**base).resolved()).build_model()
    assert isinstance(default, DigitsModel)
    assert vit.vit.patch(torch.zeros(1, 1, 48, 48)).shape[1] == GRID * GRID
    with pytest.raises(ConfigError, match="deterministic"):
        RunConfig(**base, attention="vit", align="hard").resolved()


def test_vit_weights_are_the_class_tokens_last_layer_attention():
    torch.manual_seed(0)
    model = DigitsViT(16).double().eval()
    images = torch.rand(2, 1, 48, 48, dtype=torch.float64)
    with ak.evaluation.capture(model) as records:
        logits, weights, log_prob = model(images)
    assert logits.shape == (2, 10) and log_prob is None
    vit = model.vit
    z = torch.cat([vit.cls_token.expand(2, 1, -1), vit.patch(images)], 1) + vit.pos
    first, last = vit.encoder.layers
    y = last.norm1(first(z))  # pre-norm: the last layer's attention reads Norm(x)
    w = last.self_attention(y, need_weights=True).weights  # (B, H, 1 + P, 1 + P)
    cls = w[:, :, 0, 1:].mean(1)
    torch.testing.assert_close(weights, cls / cls.sum(-1, keepdim=True))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, dtype=torch.float64))
    assert [r.shape for calls in records.values() for r in calls] == [(2, GRID * GRID)]
    torch.testing.assert_close(model.train()(images)[0], logits)  # training: logits only


def test_the_task_builds_the_recurrent_attention_model_on_request():
    base = dict(task="digits", n_train=16, n_test=8, epochs=1, batch_size=8, d_model=16)
    task = tasks.get("digits")(RunConfig(**base, attention="ram").resolved())
    torch.manual_seed(0)
    model = task.build_model()
    assert isinstance(model, DigitsRAM) and model.ram.scales == 3
    # from the centre cell, the coarsest scale (12 · 2² pixels) covers the whole 48 × 48 canvas
    centre = model.ram.centres[(RAM_GRID // 2) * (RAM_GRID + 1)]
    assert centre.tolist() == [24, 24] and model.ram.glimpse_size * 2**2 == 48
    cells = RAM_GRID * RAM_GRID
    images = task.train["images"][:8]
    model.train()
    logits, weights, log_prob = model(images)
    assert logits.shape == (8, 10) and weights.shape == (8, model.ram.glimpses, cells)
    assert (weights.sum(-1) == 1).all() and log_prob.shape == (8,) and (log_prob <= 0).all()
    # the location policy learns through REINFORCE: the task's loss reaches it
    task.loss(model, torch.arange(8)).backward()
    assert model.ram.locate.weight.grad.abs().sum() > 0
    metrics = task.evaluate(model, "test")
    assert set(metrics) == set(task.metrics)
    assert 0 <= metrics["attention_correctness"] <= 1 and metrics["entropy"] == 0  # one-hot
    assert [m["weights"].shape for m in task.heatmaps(model, 2)] == [(RAM_GRID, RAM_GRID)] * 2
    with pytest.raises(ConfigError, match="location policy"):
        RunConfig(**base, attention="ram", align="sparsemax").resolved()


def test_the_centre_baseline_keeps_every_glimpse_at_the_centre():
    """attention=ram_centre: the same retina, never moved: every glimpse at pixel (24, 24)."""
    base = dict(task="digits", n_train=16, n_test=8, epochs=1, batch_size=8, d_model=16)
    task = tasks.get("digits")(RunConfig(**base, attention="ram_centre").resolved())
    torch.manual_seed(0)
    model = task.build_model()
    for mode in (model.train, model.eval):
        mode()
        _, weights, log_prob = model(task.train["images"][:8])
        cells = weights.argmax(-1)
        assert (weights.sum(-1) == 1).all() and log_prob is None
        assert all(model.ram.centres[c].tolist() == [24, 24] for c in cells.flatten().tolist())
    task.loss(model, torch.arange(8)).backward()  # classification only: no REINFORCE term
    assert model.ram.act.weight.grad.abs().sum() > 0


def test_ram_attention_correctness_counts_glimpse_centres_inside_the_box():
    model = DigitsRAM(8)
    boxes = torch.tensor([[0, 0, 16, 16], [20, 30, 16, 16]])
    inside = model.inside(boxes)
    for n, (top, left, h, w) in enumerate(boxes.tolist()):
        for cell, (r, c) in enumerate(model.ram.centres.tolist()):
            assert bool(inside[n, cell]) == (top <= r < top + h and left <= c < left + w)
    assert inside.sum(-1).tolist() == [2 * 2, 2 * 3]  # centres at 3, 10, 17, 24, 30, 37, 44


def test_gold_is_the_cells_overlapping_the_box_and_supervision_moves_attention_there():
    config = RunConfig(task="digits", n_train=16, n_test=10, batch_size=4, d_model=8).resolved()
    task = tasks.get("digits")(config)
    boxes = task.data.splits["test"]["boxes"]
    cell = task.data.canvas / GRID
    gold = task.gold("test", torch.arange(10))
    for i in range(10):
        top, left, h, w = (float(v) for v in boxes[i])
        for r in range(GRID):
            for c in range(GRID):
                overlaps = (r * cell < top + h and (r + 1) * cell > top) and (
                    c * cell < left + w and (c + 1) * cell > left
                )
                assert bool(gold[i, r * GRID + c]) == overlaps
    from supervision_runs import kl_to_gold

    start, plain, supervised = kl_to_gold(
        "digits", steps=12, n_eval=32, n_train=96, n_test=32, batch_size=16, d_model=16, lr=2e-2
    )
    assert supervised < plain and supervised < 0.8 * start
    with pytest.raises(ConfigError, match="supervise the default model"):
        RunConfig(task="digits", attention="vit", supervise_attention=1.0).resolved()
