"""Buffers derived from hyperparameters follow every cast exactly (attnkit.derived)."""

import pytest
import torch

import attnkit as ak
from attnkit.derived import DerivedBuffers


class _Decays(DerivedBuffers):
    def __init__(self, dtype=None):
        super().__init__()
        h = torch.arange(3, dtype=torch.float64)
        self.register_derived("gamma", torch.log(1 - 2.0 ** (-5 - h)), dtype=dtype)


def _exact():
    return torch.log(1 - 2.0 ** (-5 - torch.arange(3, dtype=torch.float64)))


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.double(),
        lambda m: m.to(torch.float64),
        lambda m: m.half().double(),
        lambda m: m.to("cpu").to(dtype=torch.float64),
    ],
)
def test_a_cast_to_float64_gives_the_exact_values(cast):
    m = cast(_Decays())
    assert m.gamma.dtype == torch.float64
    assert torch.equal(m.gamma, _exact())  # not the float32 rounding (off by ~1e-9)
    assert not torch.equal(_Decays().gamma.double(), _exact())  # which a plain cast keeps


def test_a_cast_keeps_the_dtype_it_chose_and_the_state_dict_keys():
    m = _Decays(dtype=torch.float64).float()
    assert m.gamma.dtype == torch.float32
    assert torch.equal(m.gamma, _exact().float())
    assert list(m.state_dict()) == ["gamma"]


def test_retention_cast_to_float64_equals_retention_built_in_float64():
    """The reported case: Retention(4, 3).double() kept γ rounded to float32."""
    torch.manual_seed(0)
    cast = ak.mechanisms.build("retention", head_dim=4, num_heads=3).double()
    torch.manual_seed(0)
    built = ak.mechanisms.build("retention", head_dim=4, num_heads=3, dtype=torch.float64)
    want = torch.log(1 - 2.0 ** (-5 - torch.arange(3, dtype=torch.float64)))
    assert torch.equal(cast.log_gamma.flatten(), want)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 70, 4, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(cast(q, k, v).context, built(q, k, v).context, rtol=0, atol=1e-13)


def test_a_redraw_updates_the_master():
    p = ak.mechanisms.build("performer", head_dim=4, n_features=6)
    p.redraw()
    drawn = p.omega.clone()
    p.double()
    torch.testing.assert_close(p.omega.float(), drawn, rtol=0, atol=0)
