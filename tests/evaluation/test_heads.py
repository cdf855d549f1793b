"""Head gates against zeroing W^O's columns, Michel et al.'s gradient proxy against finite
differences, the pruning curve against explicit gates, per-head statistics by hand."""

import copy
import math

import pytest
import torch

import attnkit as ak
from attnkit.evaluation import heads as hd


class TwoLayers(torch.nn.Module):
    """Two self-attention layers (4 and 2 heads) with residuals."""

    def __init__(self):
        super().__init__()
        self.first = ak.MultiHeadAttention(8, 4)
        self.second = ak.MultiHeadAttention(8, 2)

    def forward(self, x):
        x = x + self.first(x).context
        return x + torch.tanh(self.second(x).context)


def encoder(seed=0):
    torch.manual_seed(seed)
    return TwoLayers().double().eval()


def mha_model(seed=0):
    torch.manual_seed(seed)
    return ak.MultiHeadAttention(8, 4).double().eval()


def test_masking_a_head_equals_zeroing_its_columns_of_the_output_projection():
    mha = mha_model()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    ref = copy.deepcopy(mha)
    with torch.no_grad():
        ref.out_proj.weight[:, 2:4] = 0  # head 1 of 4 (head_dim 2)
        ref.out_proj.weight[:, 6:8] *= 0.5  # head 3 at half
    gates = {"": torch.tensor([1.0, 0.0, 1.0, 0.5])}
    with hd.head_gates(mha, gates):
        got = mha(x).context
    torch.testing.assert_close(got, ref(x).context)
    assert not mha.out_proj._forward_pre_hooks  # removed afterwards


def test_gradient_importance_matches_finite_differences():
    model = encoder()
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def loss():
        return (model(x) ** 2).mean()

    got = hd.head_importance_by_gradient(model, loss)
    assert set(got) == {"first", "second"}
    for name, h in hd.heads_of(model).items():
        for i in range(h):
            values = []
            for delta in (1e-6, -1e-6):
                g = torch.ones(h, dtype=torch.float64)
                g[i] += delta
                with torch.no_grad(), hd.head_gates(model, {name: g}):
                    values.append(float(loss()))
            fd = abs(values[0] - values[1]) / 2e-6
            assert float(got[name][i]) == pytest.approx(fd, rel=1e-5, abs=1e-9)


def test_masking_importance_and_pruning_curve_against_explicit_gates():
    model = encoder(1)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    target = model(x).detach() + 0.1

    def metric():
        with torch.no_grad():
            return -float(((model(x) - target) ** 2).mean())

    importance = hd.head_importance_by_masking(model, metric)
    base = metric()
    for name, h in hd.heads_of(model).items():
        for i in range(h):
            g = torch.ones(h)
            g[i] = 0
            with hd.head_gates(model, {name: g}):
                assert float(importance[name][i]) == pytest.approx(base - metric())
    curve = hd.pruning_curve(model, metric, importance)
    assert curve.pruned == list(range(6)) and curve.fraction[-1] == pytest.approx(5 / 6)
    flat = sorted(
        (float(importance[n][i]), n, i) for n in importance for i in range(len(importance[n]))
    )
    assert curve.order == [(n, i) for _, n, i in flat]
    gates = {n: torch.ones(h) for n, h in hd.heads_of(model).items()}
    for (name, i), value in zip(curve.order[:3], curve.metric[1:4], strict=True):
        gates[name][i] = 0
        with hd.head_gates(model, gates):
            assert value == pytest.approx(metric())


def test_head_statistics_by_hand():
    w = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [1.0, 0.0]]]])  # (1, 2, 2, 2)
    stats = hd.head_statistics(w)
    torch.testing.assert_close(stats["entropy"], torch.tensor([math.log(2) / 2, 0.0]).double())
    torch.testing.assert_close(stats["distance"], torch.tensor([0.25, 1.0]).double())
    torch.testing.assert_close(stats["max_weight"], torch.tensor([0.75, 1.0]).double())
    mask = torch.tensor([[True, True], [False, False]])  # row 1 attends nothing: not counted
    stats = hd.head_statistics(w, mask)
    torch.testing.assert_close(stats["distance"], torch.tensor([0.0, 1.0]).double())


def test_errors():
    mha = mha_model()
    with (
        pytest.raises(ValueError, match="'x' is not a MultiHeadAttention"),
        hd.head_gates(mha, {"x": torch.ones(4)}),
    ):
        pass
    with pytest.raises(ValueError, match=r"shape \(4,\)"), hd.head_gates(mha, {"": torch.ones(3)}):
        pass
    with pytest.raises(ValueError, match=r"no attnkit\.MultiHeadAttention"):
        hd.head_importance_by_masking(torch.nn.Linear(2, 2), lambda: 0.0)
    with pytest.raises(ValueError, match="every multi-head layer"):
        hd.pruning_curve(encoder(), lambda: 0.0, {"first": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"\(B, H, M, N\)"):
        hd.head_statistics(torch.zeros(2, 2))


def _w(*shape):
    return torch.rand(*shape).softmax(-1)


BAD_CALLS = [
    (
        "mask of another width",
        lambda: hd.head_statistics(_w(2, 2, 3, 5), torch.ones(2, 3, 4, dtype=torch.bool)),
        ValueError,
        r"mask of shape \(2, 3, 4\) does not broadcast to \(2, 2, 3, 5\)",
    ),
    (
        "float mask",
        lambda: hd.head_statistics(_w(2, 2, 3, 5), torch.full((2, 1, 3, 5), 0.5)),
        TypeError,
        r"mask must be boolean \(True = may attend\).*torch.float32.*not masks",
    ),
    (
        "negative weights",
        lambda: hd.head_statistics(_w(1, 1, 2, 2) - 1, None),
        ValueError,
        r"weights must be non-negative",
    ),
    (
        "integer weights",
        lambda: hd.head_statistics(torch.ones(1, 1, 2, 2, dtype=torch.long)),
        TypeError,
        r"weights must be a floating-point tensor \(B, H, M, N\)",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()
