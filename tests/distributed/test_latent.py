"""Multi-head latent attention over the ring: :class:`RingLatentAttention` on rings of 2 and 4 gloo
processes (one forked world of 4) equals the MLA layer on the whole sequence in one process
(its expanded form, causal mask ∧ padding; float64, 1e-10), outputs, input gradients and every
parameter's gradient, both layouts, with and without query compression; a forward turn sends
the latents — d_c + d_h^R key numbers and d_c value numbers per token — not the heads' keys and
values; refusals reach every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.distributed import RingLatentAttention, shard, transport
from attnkit.modern import MultiHeadLatentAttention

sys.path.insert(0, str(Path(__file__).parent))
from forked import compare, failures_of, rings, run_world

WORLD = 4
B, E, H = 2, 16, 4
KV_RANK, HEAD, ROPE, V_HEAD = 6, 4, 2, 3


def _layer(q_rank: int | None) -> MultiHeadLatentAttention:
    torch.manual_seed(13)  # the same parameters on every rank
    return MultiHeadLatentAttention(
        E, H, KV_RANK, head_dim=HEAD, rope_dim=ROPE, v_head_dim=V_HEAD, q_rank=q_rank,
        bias=True, dtype=torch.float64,
    )  # fmt: skip


def _check(rank, size, group, layout, q_rank, failures):
    mla = _layer(q_rank)
    seq = 4 * size
    g = torch.Generator().manual_seed(seq)
    x, w = (torch.randn(B, seq, E, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([seq - 3, seq])
    full = x.clone().requires_grad_()
    mask = ak.masks.from_lengths(lengths, seq) & torch.ones(seq, seq, dtype=torch.bool).tril()
    want = mla(full, mask).output  # expanded keys and values
    (want * w).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in mla.named_parameters()}
    mla.zero_grad(set_to_none=True)
    local = shard(x, rank, size, layout=layout).requires_grad_()
    pad = shard(ak.masks.from_lengths(lengths, seq), rank, size, layout=layout, dim=-1)
    out = RingLatentAttention(mla, group=group, layout=layout, causal=True)(local, pad).output
    (out * shard(w, rank, size, layout=layout)).sum().backward()
    label = f"P={size} MLA {layout} q_rank={q_rank}"
    compare(out.detach(), shard(want.detach(), rank, size, layout=layout), label, failures)
    compare(local.grad, shard(full.grad, rank, size, layout=layout), f"{label} dx", failures)
    for n, p in mla.named_parameters():
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        compare(grad, want_grads[n], f"{label}: gradient of {n}", failures)


def _traffic(rank, size, group, failures) -> int:
    mla = _layer(None)
    local = torch.randn(B, 4, E, dtype=torch.float64)
    transport.reset_traffic()
    with torch.no_grad():
        RingLatentAttention(mla, group=group, causal=True)(local)
    element = local.element_size()
    latents = (size - 1) * B * 4 * ((KV_RANK + ROPE) + KV_RANK) * element
    expanded = (size - 1) * B * H * 4 * ((HEAD + ROPE) + V_HEAD) * element
    if transport.bytes_sent() != latents:
        failures.append(f"a forward turn sent {transport.bytes_sent()} bytes, not {latents}")
    if not latents < expanded:
        failures.append("the latents are not smaller than the heads' keys and values here")
    return 1


def _refusals(rank, size, group, failures) -> int:
    mla = _layer(None)
    local = torch.randn(B, 4, E, dtype=torch.float64)
    causal_mask = torch.ones(4, 4, dtype=torch.bool).tril()
    checks = 0
    for what, call, said in (
        (
            "weights asked on rank 0",
            lambda: RingLatentAttention(mla, group=group)(local, need_weights=rank == 0),
            "does not return weights",
        ),
        (
            "a causal mask to a non-causal twin",
            lambda: RingLatentAttention(mla, group=group)(local, causal_mask),
            "pass causal=True",
        ),
    ):
        try:
            call()
            failures.append(f"{what} was accepted")
        except ValueError as err:
            checks += 1
            if said not in str(err) or "every rank raises this error" not in str(err):
                failures.append(f"unclear message for {what}: {err}")
    return checks


def _worker(rank: int, world: int, failures: list[str]) -> dict:
    checks: dict[str, int] = {}
    for size, group in rings(rank, world):
        cases = [("contiguous", 5), ("zigzag", None)] if size == 2 else [("zigzag", 5)]
        for layout, q_rank in cases:
            _check(rank, size, group, layout, q_rank, failures)
        done = len(cases) + _traffic(rank, size, group, failures)
        checks[str(size)] = done + _refusals(rank, size, group, failures)
    return checks


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("latent"))


@pytest.mark.parametrize("size", [2, 4])
def test_latent_attention_over_a_ring_equals_one_process(size, reports):
    assert not failures_of(reports), failures_of(reports)
    expected = {2: 2 + 1 + 2, 4: 1 + 1 + 2}[size]
    assert [r["checks"][str(size)] for r in reports[:size]] == [expected] * size


def test_only_latent_attention_layers_are_taken():
    with pytest.raises(TypeError, match=r"must be an attnkit\.modern\.MultiHeadLatentAttention"):
        RingLatentAttention(ak.MultiHeadAttention(8, 2))


def test_the_twin_shares_the_parameters():
    mla = _layer(5)
    twin = RingLatentAttention(mla, causal=True)
    assert [id(p) for p in twin.parameters()] == [id(p) for p in mla.parameters()]
