"""The dates task's coverage option (``attention=coverage``): the decoder's additive score
takes the coverage vector (See et al. eqs. 10-11) and the loss adds the coverage loss (eq. 12);
the repeated-attention metric."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.runner import run
from attnkit.tasks.dates_task import CoverageSeq2Seq, repeated_attention


def test_coverage_decoder_equals_a_loop_from_the_equations():
    torch.manual_seed(0)
    d, v_in, v_out = 6, 9, 7
    model = CoverageSeq2Seq(v_in, v_out, d, bidirectional=True, enc_hidden=3).double()
    src = torch.tensor([[2, 3, 4, 5, 0], [6, 7, 8, 0, 0]])
    mask = src != 0
    tgt_in = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 2]])
    out = model(src, tgt_in, mask)

    att = model.coverage_attention
    states, h = model.encode(src, mask)
    b, n = src.shape
    coverage = torch.zeros(b, n, dtype=torch.float64)
    context = torch.zeros(b, states.shape[-1], dtype=torch.float64)
    for t in range(tgt_in.shape[1]):
        h = model.cell(torch.cat([model.embed_out(tgt_in[:, t]), context], -1), h)
        for i in range(b):
            e = torch.empty(n, dtype=torch.float64)
            for j in range(n):  # e_j = vᵀ tanh(W_h h_j + W_s s_t + b + w_c c_j)  (eq. 11)
                pre = att.W_h.weight @ states[i, j] + att.W_s.weight @ h[i] + att.W_s.bias
                e[j] = att.v.weight[0] @ torch.tanh(pre + att.w_c * coverage[i, j])
            e[~mask[i]] = float("-inf")
            a = torch.exp(e - e.max()) / torch.exp(e - e.max()).sum()
            torch.testing.assert_close(out.weights[i, t], a)
            coverage[i] = coverage[i] + a  # eq. 10
        weights = out.weights[:, t]
        context = torch.stack([(weights[i, :, None] * states[i]).sum(0) for i in range(b)])
        logits = model.out(torch.cat([h, context], -1))
        torch.testing.assert_close(out.logits[:, t], logits)


def test_repeated_attention_by_hand():
    # two steps over three characters (the third one padding in the second item)
    weights = torch.tensor(
        [
            [[0.9, 0.1, 0.0], [0.8, 0.0, 0.2]],  # char 0 gets 1.7: 0.7 beyond 1
            [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]],  # every char gets 1: nothing repeated
        ]
    )
    mask = torch.tensor([[True, True, True], [True, True, False]])
    torch.testing.assert_close(repeated_attention(weights, mask), torch.tensor([0.35, 0.0]))


def test_the_run_option_end_to_end(tmp_path):
    base = dict(task="dates", n_train=40, n_test=10, epochs=1, batch_size=20, d_model=8)
    config = RunConfig(**base, attention="coverage")
    model = tasks.get("dates")(config.resolved()).build_model()
    assert isinstance(model, CoverageSeq2Seq)
    with pytest.raises(ConfigError, match="coverage"):
        RunConfig(**base, attention="coverage", align="hard").resolved()
    run(config, tmp_path / "run")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0 <= metrics["repeated_attention"] <= 1
    assert "aer_argmax" in metrics
