"""context_parallel: the ring twin of a model shares its parameters and refuses parts the ring
cannot evaluate, and a causal that contradicts the model. Twins of whole models — DecoderLM
(RoPE, ALiBi, learned absolute positions at global offsets) and the encoder-decoder Transformer
with padding — equal the model on the whole sequence on 2 gloo processes (forked, a FileStore in
tmp_path), outputs and every parameter's gradient in float64; twins of single layers with
each position scheme are checked by the workers of test_positions.py."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import attnkit as ak
from attnkit.distributed import RingAbsolute, RingAttention, context_parallel, shard
from attnkit.models.decoder_lm import DecoderLM
from attnkit.positions import ALiBi


def test_parts_the_ring_cannot_evaluate_are_refused_by_name():
    with pytest.raises(ValueError, match=r"dropout 0\.1 is not offered"):
        context_parallel(ak.MultiHeadAttention(8, 2, dropout=0.1))
    with pytest.raises(ValueError, match=r"no attnkit\.MultiHeadAttention layer"):
        context_parallel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="cannot evaluate this part"):
        context_parallel(ak.MultiHeadAttention(8, 2, align="hard"))


def test_the_twin_shares_the_parameters():
    mha = ak.MultiHeadAttention(8, 2, position="alibi")
    twin = context_parallel(mha)
    assert [id(p) for p in twin.parameters()] == [id(p) for p in mha.parameters()]
    assert type(mha.attention) is ak.Attention  # the model itself is unchanged
    assert isinstance(mha.position, ALiBi)


def test_the_twin_moves_the_position_scheme_into_the_ring_part():
    mha = ak.MultiHeadAttention(8, 2, position="t5")
    twin = context_parallel(mha, layout="zigzag", causal=True)
    assert isinstance(twin.attention, RingAttention)
    assert twin.attention.position.scheme.weight is mha.position.weight  # T5's table, shared
    assert type(twin.position).__name__ == "NoPosition"
    assert (twin.attention.layout, twin.attention.causal) == ("zigzag", True)


# ---- whole models over a ring of 2 gloo processes, against the model on one process --------

WORLD = 2
TOL = 1e-10


def _compare(got, want, what, failures):
    err = float((got - want).abs().max())
    if not err <= TOL:  # also NaN
        failures.append(f"{what} differs by {err:.3g}")


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_twin(model, twin, whole, parts, rank, layout, what, failures):
    """``whole()`` runs the model on the whole sequences, ``parts(twin)`` the twin on this
    rank's part, each returning (output, weights of the loss, sequence dim); outputs and every
    parameter's gradient (summed over the ring) must equal the model's."""
    model.zero_grad(set_to_none=True)
    out, w = whole()
    (out * w).sum().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    part, w_part = parts(twin)
    (part * w_part).sum().backward()
    got = _grads(model)  # the twin's parameters are the model's
    for g in got.values():
        dist.all_reduce(g)
    _compare(part.detach(), shard(out.detach(), rank, WORLD, layout=layout), what, failures)
    if sorted(got) != sorted(want):
        failures.append(f"{what}: gradients of {sorted(set(want) ^ set(got))} missing")
    for n in want:
        if n in got:
            _compare(got[n], want[n], f"{what}: gradient of {n}", failures)


def _decoder_lm(rank, layout, causal, position, failures):
    torch.manual_seed(7)
    kw = {"position": position} if position else {}
    lm = DecoderLM(50, 16, 2, 2, max_len=24, dtype=torch.float64, **kw)
    tokens = torch.randint(0, 50, (2, 12))
    w = torch.randn(2, 12, 50, dtype=torch.float64)
    twin = context_parallel(lm, layout=layout, **({} if causal is None else {"causal": causal}))
    _check_twin(
        lm,
        twin,
        lambda: (lm(tokens), w),
        lambda t: (
            t(shard(tokens, rank, WORLD, layout=layout, dim=1)),
            shard(w, rank, WORLD, layout=layout),
        ),
        rank,
        layout,
        f"DecoderLM position={position} causal={causal} {layout}",
        failures,
    )


def _encoder_decoder(rank, layout, failures):
    torch.manual_seed(8)
    model = ak.Transformer(
        16, 2, encoder_layers=1, decoder_layers=2, d_ff=24, dropout=0.0, position="alibi",
        dtype=torch.float64,
    )  # fmt: skip
    src = torch.randn(2, 8, 16, dtype=torch.float64)
    tgt = torch.randn(2, 12, 16, dtype=torch.float64)
    w = torch.randn(2, 12, 16, dtype=torch.float64)
    src_pad = ak.masks.from_lengths(torch.tensor([8, 5]), 8)  # (B, 1, N)
    tgt_pad = ak.masks.from_lengths(torch.tensor([12, 9]), 12)  # (B, 1, M)
    twin = context_parallel(model, layout=layout)

    def parts(t):
        s, p = shard(src, rank, WORLD, layout=layout), shard(tgt, rank, WORLD, layout=layout)
        sp = shard(src_pad, rank, WORLD, layout=layout, dim=-1)
        tp = shard(tgt_pad, rank, WORLD, layout=layout, dim=-1)
        out = t(s, p, src_mask=sp, tgt_mask=tp, memory_mask=sp)
        return out, shard(w, rank, WORLD, layout=layout)

    try:  # the decoder called non-causally: the twin's causal part refuses it on every rank
        memory = shard(src, rank, WORLD, layout=layout)
        twin.decoder(shard(tgt, rank, WORLD, layout=layout), memory, causal=False)
        failures.append("a decoder called with causal=False ran on a causal twin")
    except ValueError as err:
        if "passed no causal mask" not in str(err) or "refused on rank 0, 1 of 2" not in str(err):
            failures.append(f"unclear message for a decoder called with causal=False: {err}")
    _check_twin(
        model,
        twin,
        lambda: (model(src, tgt, src_mask=src_pad, tgt_mask=tgt_pad, memory_mask=src_pad), w),
        parts,
        rank,
        layout,
        f"Transformer (encoder-decoder) {layout}",
        failures,
    )


def _past_the_table(rank, failures):
    """32 tokens over 2 ranks for a table of 24 positions: only rank 1's positions are past
    it, and both ranks raise the same ValueError."""
    torch.manual_seed(7)
    lm = DecoderLM(50, 16, 2, 1, max_len=24, dtype=torch.float64)
    tokens = torch.randint(0, 50, (1, 32))
    try:
        context_parallel(lm)(shard(tokens, rank, WORLD, dim=1))
        failures.append("positions past the learned table were accepted")
        return ""
    except ValueError as err:
        if "refused on rank 1 of 2" not in str(err) or "max_len = 24" not in str(err):
            failures.append(f"unclear message for positions past the table: {err}")
        return str(err)


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    failures: list[str] = []
    said = ""
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=30),
        )
        for layout in ("contiguous", "zigzag"):
            _decoder_lm(rank, layout, True, "rope", failures)  # the call
            _encoder_decoder(rank, layout, failures)
        _decoder_lm(rank, "zigzag", None, None, failures)  # learned absolute positions
        _decoder_lm(rank, "contiguous", None, "alibi", failures)
        said = _past_the_table(rank, failures)
    except Exception:
        failures.append(traceback.format_exc())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"failures": failures, "said": said}))
    os._exit(0)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("parallel")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(r, str(out / "store"), str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 180.0
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_twins_of_whole_models_equal_the_models(reports):
    failures = [f"rank {r}: {f}" for r, rep in enumerate(reports) for f in rep["failures"]]
    assert not failures, "\n".join(failures)
    assert reports[0]["said"] == reports[1]["said"]  # one refusal, the same on both ranks


def test_causal_that_contradicts_the_model_is_refused_when_the_twin_is_made():
    lm = DecoderLM(50, 16, 2, 2, max_len=24, position="rope")
    with pytest.raises(ValueError, match=r"causal=False .* 'decoder\.layers\.0\.self_attention"):
        context_parallel(lm, causal=False)
    model = ak.Transformer(16, 2, encoder_layers=1, decoder_layers=1, d_ff=24, dropout=0.0)
    with pytest.raises(ValueError, match=r"causal=True .* layer 'encoder\.layers\.0\."):
        context_parallel(model, causal=True)


def test_decoder_self_attention_is_causal_in_the_twin_and_the_rest_is_not():
    model = ak.Transformer(16, 2, encoder_layers=1, decoder_layers=1, d_ff=24, dropout=0.0)
    twin = context_parallel(model, layout="zigzag")
    causal = {name: m.causal for name, m in twin.named_modules() if isinstance(m, RingAttention)}
    assert causal == {
        "encoder.layers.0.self_attention.module.attention": False,
        "decoder.layers.0.self_attention.module.attention": True,
        "decoder.layers.0.cross_attention.module.attention": False,
    }
    lm = DecoderLM(50, 16, 2, 1, max_len=24)
    twin = context_parallel(lm)
    assert isinstance(twin.positions, RingAbsolute)
    assert twin.positions.embedding.weight is lm.positions.weight  # shared, not copied
