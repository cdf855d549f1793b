"""The gated linear family over a ring: each rank's part of the sequence, its state composed from
the other ranks' transitions, equals the part on the whole sequence in one process (float64,
1e-10), outputs, input gradients and parameter gradients, for every registered part that
declares a recurrent state (retention, GLA, Mamba-2's SSD, DeltaNet, Gated DeltaNet, KDA,
lightning attention), both layouts, with padding, on rings of 2 and 4 gloo processes
(one forked world of 4; the ring of 2 is a subgroup). The transitions themselves are checked
against the products of the per-position maps written from the papers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.distributed import (
    RingLinearAttention,
    context_parallel,
    reasons_not_recurrent,
    ring_recurrence,
    shard,
)
from attnkit.distributed.linear_ring import _affine_run

sys.path.insert(0, str(Path(__file__).parent))
from forked import compare, failures_of, rings, run_world

WORLD = 4
B, H, D = 2, 2, 4
# Every registered part that declares a recurrent state (retention, GLA, Mamba-2, DeltaNet,
# Gated DeltaNet, KDA, lightning attention, …): a new one is checked here by registering.
PARTS = tuple(
    name
    for name in ak.mechanisms.REGISTRY.available()
    if getattr(ak.mechanisms.REGISTRY.get(name), "takes_cache", False)
    and getattr(ak.mechanisms.REGISTRY.get(name), "causal", False) is True
)


def _part(name: str, **kw):
    torch.manual_seed(5)  # the same parameters on every rank
    return ak.mechanisms.build(name, head_dim=D, num_heads=H, chunk_size=3, **kw).double()


def _inputs(name: str, seq: int, padded: bool):
    g = torch.Generator().manual_seed(seq + len(name))
    d_v = D if name == "retention" else 3  # retention's GroupNorm has d channels
    q, k = (torch.randn(B, H, seq, D, generator=g, dtype=torch.float64) for _ in range(2))
    v, w = (torch.randn(B, H, seq, d_v, generator=g, dtype=torch.float64) for _ in range(2))
    pad = None
    if padded:
        pad = torch.ones(B, seq, dtype=torch.bool)
        pad[0, -3:] = False  # trailing padding
        pad[1, 1:4] = False  # padding inside the sequence
    return q, k, v, w, pad


def _one_process(part, q, k, v, w, pad):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    part.zero_grad(set_to_none=True)
    mask = None if pad is None else pad[:, None, None, :]
    out = part(q, k, v, mask=mask).context
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in part.named_parameters()}
    return out.detach(), q.grad, k.grad, v.grad, grads


def _check(part, inputs, rank, size, group, layout, label, failures):
    q, k, v, w, pad = inputs
    want = _one_process(part, q, k, v, w, pad)
    part.zero_grad(set_to_none=True)
    local = [shard(x, rank, size, layout=layout).clone().requires_grad_() for x in (q, k, v)]
    pad_l = None if pad is None else shard(pad, rank, size, layout=layout, dim=-1)
    out = ring_recurrence(part, *local, group=group, layout=layout, key_padding_mask=pad_l)
    (out.context * shard(w, rank, size, layout=layout)).sum().backward()
    got = [out.context.detach(), *(x.grad for x in local)]
    for name, g, ref in zip(("context", "dq", "dk", "dv"), got, want[:4], strict=True):
        compare(g, shard(ref, rank, size, layout=layout), f"{label}: {name}", failures)
    for n, p in part.named_parameters():
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=group)  # each rank holds its positions' part
        compare(grad, want[4][n], f"{label}: gradient of {n}", failures)


def _layer(rank, size, group, layout, failures):
    """MultiHeadAttention holding Gated DeltaNet with RoPE, and its context_parallel twin (RoPE
    at global positions), the twin given this rank's causal mask ∧ padding."""
    torch.manual_seed(9)
    embed, seq = H * D, 8 * size
    part = ak.mechanisms.build("gated_deltanet", head_dim=D, num_heads=H, chunk_size=3)
    layer = ak.MultiHeadAttention(embed, H, attention=part, position="rope").double()
    twin = context_parallel(layer, group=group, layout=layout)
    if not isinstance(twin.attention, RingLinearAttention):
        failures.append(f"the twin holds {type(twin.attention).__name__}")
    g = torch.Generator().manual_seed(3)
    x, w = (torch.randn(B, seq, embed, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([seq - 3, seq])
    full = x.clone().requires_grad_()
    ref = layer(full, full, full, mask=ak.masks.from_lengths(lengths, seq)).context
    (ref * w).sum().backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    local = shard(x, rank, size, layout=layout).requires_grad_()
    pad = shard(ak.masks.from_lengths(lengths, seq), rank, size, layout=layout, dim=-1)
    mask = pad & torch.ones(seq // size, seq // size, dtype=torch.bool).tril()  # a decoder's
    out = twin(local, local, local, mask=mask).context
    (out * shard(w, rank, size, layout=layout)).sum().backward()
    label = f"P={size} {layout} MultiHeadAttention(gated_deltanet, rope)"
    compare(out.detach(), shard(ref.detach(), rank, size, layout=layout), label, failures)
    compare(local.grad, shard(full.grad, rank, size, layout=layout), f"{label} dx", failures)
    for n, p in layer.named_parameters():
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        compare(grad, want[n], f"{label}: gradient of {n}", failures)


def _later_nan(rank, size, group, failures):
    """A NaN value at the last position reaches no earlier rank's output."""
    part = _part("gated_deltanet")
    q, k, v, _, _ = _inputs("gated_deltanet", 8 * size, padded=False)
    v = v.clone()
    v[..., -1, :] = float("nan")
    with torch.no_grad():
        want = part(q, k, v).context
        local = [shard(x, rank, size) for x in (q, k, v)]
        out = ring_recurrence(part, *local, group=group).context
    if rank < size - 1:
        compare(out, shard(want, rank, size), f"P={size} a later NaN", failures)


def _refusals(rank, size, group, failures) -> int:
    """Calls that one rank refuses or that differ between ranks: every rank raises the same
    ValueError, and the group still works afterwards."""
    part = _part("deltanet")
    q, k, v, _, _ = _inputs("deltanet", 8 * size, padded=False)
    n = 8 if rank else 6  # rank 0 holds fewer positions
    bad = [x[..., :n, :] for x in (q, k, v)]
    checks = 0
    for what, call in (
        ("different lengths", lambda: ring_recurrence(part, *bad, group=group)),
        (
            "an odd zigzag part",
            lambda: ring_recurrence(
                part, *(x[..., :7, :] for x in (q, k, v)), group=group, layout="zigzag"
            ),
        ),
    ):
        try:
            call()
            failures.append(f"{what} were accepted")
        except ValueError as err:
            checks += 1
            said = str(err)
            if "every rank raises this error" not in said:
                failures.append(f"unclear message for {what}: {said}")
    out = ring_recurrence(part, *(x[..., :8, :] for x in (q, k, v)), group=group).context
    checks += int(out.shape == (B, H, 8, 3))
    return checks


def _worker(rank: int, world: int, failures: list[str]) -> dict:
    checks: dict[str, int] = {}
    for size, group in rings(rank, world):
        done = 0
        if size == 2:
            cases = [(n, lay, lay == "zigzag") for n in PARTS for lay in ("contiguous", "zigzag")]
        else:
            cases = [(n, "zigzag", True) for n in PARTS]
        for name, layout, padded in cases:
            part = _part(name)
            label = f"P={size} {name} {layout} pad={padded}"
            inputs = _inputs(name, 8 * size, padded)
            _check(part, inputs, rank, size, group, layout, label, failures)
            done += 1
        if size == 2:  # the recurrent form, one position at a time
            part = _part("gla", form="recurrent")
            inputs = _inputs("gla", 16, True)
            _check(part, inputs, rank, size, group, "zigzag", "P=2 gla recurrent", failures)
            done += 1
        for layout in ("contiguous", "zigzag"):
            _layer(rank, size, group, layout, failures)
            done += 1
        _later_nan(rank, size, group, failures)
        done += 1
        checks[str(size)] = done + _refusals(rank, size, group, failures)
    return checks


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("linear_ring"))


@pytest.mark.parametrize("size", [2, 4])
def test_the_linear_family_over_a_ring_equals_one_process(size, reports):
    assert not failures_of(reports), failures_of(reports)
    expected = {2: 2 * len(PARTS) + 1, 4: len(PARTS)}[size] + 2 + 1 + 3
    members = reports[:size]
    assert [r["checks"][str(size)] for r in members] == [expected] * size


@pytest.mark.parametrize("name", ["gla", "gated_deltanet"])
def test_one_run_gives_the_transition_and_the_state_from_zero(name):
    """[B | A] from one run of the part's kernel: B the state reached from zero, A the product
    of the per-position maps S ↦ diag(exp g_t) S (GLA) or S ↦ α_t (I − β_t k_t k_tᵀ) S (gated
    delta rule, Yang et al. 2024 eq. 10), written here as a loop; [o⁰ | Q̃] the outputs from
    zero and what each query reads of an incoming state."""
    part = _part(name)
    q, k, v, _, _ = _inputs(name, 7, padded=False)
    x = part.prepare(q, k, v)
    out, last = _affine_run(part, x, "chunkwise")
    eye = torch.eye(D, dtype=torch.float64)
    a = eye.expand(B, H, D, D)
    s = torch.zeros(B, H, D, v.shape[-1], dtype=torch.float64)
    reads, outs = [], []
    for t in range(7):
        k_t = x.k[..., t, :, None]
        if x.beta is None:
            step = torch.diag_embed(x.g[..., t, :].exp().expand(B, H, D))
            s = step @ s + k_t * x.v[..., t, None, :]
        else:
            step = x.g[..., t, :, None].exp() * (eye - x.beta[..., t, :, None] * k_t * k_t.mT)
            s = step @ s + x.beta[..., t, :, None] * k_t * x.v[..., t, None, :]
        a = step @ a
        reads.append((x.q[..., t, None, :] @ a).squeeze(-2))
        outs.append((x.q[..., t, None, :] @ s).squeeze(-2))
    d_v = v.shape[-1]
    torch.testing.assert_close(last[..., :d_v], s, rtol=0, atol=1e-12)
    torch.testing.assert_close(last[..., d_v:], a, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[..., :d_v], torch.stack(outs, -2), rtol=0, atol=1e-12)
    torch.testing.assert_close(out[..., d_v:], torch.stack(reads, -2), rtol=0, atol=1e-12)


def test_the_family_is_found_in_the_registry():
    assert {"retention", "gla", "mamba2", "deltanet", "gated_deltanet"} <= set(PARTS)


def test_parts_without_a_recurrent_state_are_refused_by_name():
    with pytest.raises(ValueError, match=r"Attention keeps no recurrent state \(takes_cache"):
        RingLinearAttention(ak.Attention())
    reasons = reasons_not_recurrent(ak.modern.SinkAttention(2))
    assert any("SinkAttention keeps no recurrent state" in r for r in reasons)
    assert reasons_not_recurrent(torch.nn.Linear(2, 2)) == [
        "Linear is not a per-head attention part (attnkit.head.HeadAttention)"
    ]
    assert reasons_not_recurrent(_part("mamba2")) == []


def test_a_position_bias_is_refused_for_a_linear_part():
    with pytest.raises(ValueError, match="ALiBi adds a bias to the scores"):
        RingLinearAttention(_part("gla"), position="alibi")


def test_refused_without_a_process_group():
    q = torch.randn(1, H, 4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="init_process_group"):
        ring_recurrence(_part("retention"), q, q, q)
    with pytest.raises(ValueError, match="heads of size"):
        ring_recurrence(_part("retention"), q[..., :3], q[..., :3], q[..., :3])
