"""The digits task's ViT option: the task builds it on ``attention=vit``, and its reported
weights are the class token's last-layer attention over the patches (mean over heads,
renormalised), read independently from the last layer's multi-head attention."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.digits_task import GRID, DigitsModel, DigitsViT


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
