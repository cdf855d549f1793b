"""Which form each part takes over the ring: context_parallel gives the score × alignment part,
the sink part, the parts that declare a recurrent state and multi-head latent attention their
ring twins (sharing the parameters), refuses a part that no form claims naming every form's
reason, and the twin of a hybrid stack — Gated DeltaNet, sinks and MLA layers, RoPE, causal,
padded — equals the stack in one process on rings of 2 and 4 gloo processes (float64, outputs
and every parameter's gradient).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.distributed import (
    RingAttention,
    RingLatentAttention,
    RingLinearAttention,
    StreamingSinkSoftmax,
    context_parallel,
    shard,
)
from attnkit.distributed.forms import FORMS, Placement, ring_part
from attnkit.modern import DifferentialAttention, MultiHeadLatentAttention, SinkAttention

sys.path.insert(0, str(Path(__file__).parent))
from forked import compare, failures_of, rings, run_world

WORLD = 4
B, E, H = 2, 8, 2


class _Hybrid(nn.Module):
    """Three causal token mixers in a residual stack: Gated DeltaNet (RoPE), sink attention
    (RoPE) and multi-head latent attention."""

    causal_attention = ("linear", "sinks", "latent")

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(21)
        part = ak.mechanisms.build("gated_deltanet", head_dim=E // H, num_heads=H, chunk_size=3)
        self.linear = ak.MultiHeadAttention(E, H, attention=part, position="rope")
        self.sinks = ak.MultiHeadAttention(E, H, attention=SinkAttention(H), position="rope")
        self.latent = MultiHeadLatentAttention(E, H, 6, head_dim=4, rope_dim=2, q_rank=5)
        with torch.no_grad():
            self.sinks.attention.sinks.copy_(torch.tensor([0.3, 1.5]))
        self.double()

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        length = x.shape[-2]
        mask = pad & torch.ones(length, length, dtype=torch.bool).tril()  # a decoder's
        h = x + self.linear(x, x, x, mask=mask).context
        h = h + self.sinks(h, h, h, mask=mask).context
        return h + self.latent(h, mask).output


def test_each_part_gets_its_form_sharing_the_parameters():
    model = _Hybrid()
    twin = context_parallel(model, layout="zigzag")
    assert [id(p) for p in twin.parameters()] == [id(p) for p in model.parameters()]
    assert isinstance(twin.linear.attention, RingLinearAttention)
    assert twin.linear.attention.position is not None  # RoPE moved into the ring part
    ring = twin.sinks.attention
    assert isinstance(ring, RingAttention) and ring.causal
    assert isinstance(ring.align, StreamingSinkSoftmax)
    assert ring.align.sinks is model.sinks.attention.sinks
    assert isinstance(twin.latent, RingLatentAttention) and twin.latent.causal
    assert isinstance(context_parallel(twin).latent.module, MultiHeadLatentAttention)  # not twice
    assert isinstance(context_parallel(model.latent), RingLatentAttention)
    assert [name for name, _ in FORMS] == ["score × alignment", "sinks", "recurrent state"]


def test_a_part_no_form_claims_is_refused_with_every_reason():
    layer = ak.MultiHeadAttention(E, H, attention=DifferentialAttention(E // H))
    with pytest.raises(ValueError) as err:
        context_parallel(layer)
    said = str(err.value)
    assert "attention part DifferentialAttention cannot run over a ring" in said
    assert "score × alignment: it is not the score × alignment part" in said
    assert "sinks: it is not a sink part" in said
    assert "recurrent state: attention part DifferentialAttention keeps no recurrent state" in said


def test_a_form_that_claims_a_part_gives_its_own_reason():
    with pytest.raises(ValueError, match="cannot evaluate this part"):
        context_parallel(ak.MultiHeadAttention(E, H, align="hard"))
    retention = ak.mechanisms.build("retention", head_dim=E // H, num_heads=H)
    with pytest.raises(ValueError, match="adds a bias to the scores"):
        context_parallel(ak.MultiHeadAttention(E, H, attention=retention, position="alibi"))
    where = Placement(None, "contiguous", True, None)
    assert isinstance(ring_part(SinkAttention(H), where), RingAttention)


def _worker(rank: int, world: int, failures: list[str]) -> dict:
    checks: dict[str, int] = {}
    for size, group in rings(rank, world):
        layout = "zigzag" if size == 2 else "contiguous"
        model = _Hybrid()
        twin = context_parallel(model, group=group, layout=layout)
        seq = 8 * size
        g = torch.Generator().manual_seed(seq)
        x, w = (torch.randn(B, seq, E, generator=g, dtype=torch.float64) for _ in range(2))
        pad = ak.masks.from_lengths(torch.tensor([seq - 3, seq]), seq)  # (B, 1, S)
        full = x.clone().requires_grad_()
        (model(full, pad) * w).sum().backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            ref = model(x, pad)
        model.zero_grad(set_to_none=True)
        local = shard(x, rank, size, layout=layout).requires_grad_()
        out = twin(local, shard(pad, rank, size, layout=layout, dim=-1))
        (out * shard(w, rank, size, layout=layout)).sum().backward()
        label = f"P={size} {layout} hybrid"
        compare(out.detach(), shard(ref, rank, size, layout=layout), label, failures)
        compare(local.grad, shard(full.grad, rank, size, layout=layout), f"{label} dx", failures)
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if sorted(got) != sorted(want):
            failures.append(f"{label}: gradients of {sorted(set(want) ^ set(got))} missing")
        for n, grad in got.items():
            torch.distributed.all_reduce(grad, group=group)
            compare(grad, want[n], f"{label}: gradient of {n}", failures)
        checks[str(size)] = 1
    return checks


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("forms"))


@pytest.mark.parametrize("size", [2, 4])
def test_the_twin_of_a_hybrid_stack_equals_the_stack(size, reports):
    assert not failures_of(reports), failures_of(reports)
    assert [r["checks"][str(size)] for r in reports[:size]] == [1] * size
