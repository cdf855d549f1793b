"""A decoder-only LM over a hybrid plan: greedy generation through the per-layer caches equals
the uncached pass token for token (float64), batched generation over left-padded prompts equals
each prompt alone, and an all-``full`` plan is the model of that many layers."""

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.mixers import MixerCache, TokenMixer
from attnkit.models.batched_generation import generate_batch
from attnkit.models.decoder_lm import DecoderLM
from attnkit.paged_cache import PagedKVCache

V = 11


class _Mean(TokenMixer):
    """The running mean of a projection over the real positions so far (state: sum, count)."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.v = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, *, mask=None, cache: MixerCache | None = None):
        keep = torch.ones(*x.shape[:2], 1, dtype=x.dtype)
        if mask is not None:
            keep = mask.reshape(x.shape[0], x.shape[1], 1).to(x.dtype)
        total, count = (self.v(x) * keep).cumsum(1), keep.cumsum(1)
        if cache is not None:
            cache.claim(self)
            if cache.states:
                total = total + cache.states["total"][:, None]
                count = count + cache.states["count"][:, None]
            cache.advance(x.shape[1], total=total[:, -1], count=count[:, -1])
        return total / count.clamp(min=1)


class _Bidirectional(_Mean):
    causal = False


def _mean(embed_dim, **sizes):
    return _Mean(embed_dim)


PLANS = {
    "gated_deltanet-full": ("1 gated_deltanet : 1 full", {}),
    "sliding-full-rope": ("2 sliding:3 : 1 full", {"position": "rope"}),
    # a window slot first: the learned positions' offset is the positions seen, not kept
    "sliding-first-learned": ("1 sliding:2 : 1 gated_deltanet", {}),
    "mixer-sliding-retention": ([_mean, "sliding:2", "retention"], {}),
    "mamba2-gla-alibi": ("1 mamba2 : 1 gla : 1 full", {"position": "alibi"}),
    "gated_deltanet-layer": ("1 mixer.gated_deltanet : 1 full", {}),
    # Qwen3-Next's order: Gated DeltaNet layers, then a gated full-attention layer with RoPE
    "qwen3_next-like": (
        "3 mixer.gated_deltanet : 1 full",
        {"position": "rope", "gate": "elementwise", "num_kv_heads": 1},
    ),
}


def _lm(plan, **kw):
    """A tiny untied model with large random weights, so that its greedy tokens vary."""
    torch.manual_seed(0)
    lm = DecoderLM(V, 12, 2, plan, max_len=24, dtype=torch.float64, tie_embeddings=False, **kw)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() > 1 or "position" in name:
                p.normal_(0, 1.0)
    return lm.eval()


def _prompts(lengths=(1, 4, 2, 6)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("name", list(PLANS))
def test_cached_generation_equals_the_uncached_pass(name):
    plan, kw = PLANS[name]
    lm = _lm(plan, **kw)
    prompt = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(2))
    cached = lm.generate(prompt, 10)
    # the reference: every step the whole sequence, greedy, without a cache
    want = prompt
    for _ in range(10):
        want = torch.cat([want, lm(want)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cached, want)
    assert torch.equal(lm.generate(prompt, 10, use_cache=False), want)
    assert len(set(want[0, 4:].tolist())) > 1  # the continuation is not one repeated token


def test_an_all_full_plan_is_the_model_of_that_many_layers():
    prompt = torch.tensor([[1, 2, 3]])
    old, new = _lm(3, position="rope"), _lm("full", num_layers=3, position="rope")
    assert torch.equal(old(prompt), new(prompt))
    assert torch.equal(old.generate(prompt, 6), new.generate(prompt, 6))
    assert type(new.new_cache()[0]) is ak.kv_cache.LayerCache


@pytest.mark.parametrize("name", ["gated_deltanet-full", "mixer-sliding-retention"])
def test_a_padded_batch_generates_what_each_prompt_generates_alone(name):
    plan, kw = PLANS[name]
    lm = _lm(plan, **kw)
    prompts = _prompts()
    alone = [lm.generate(p[None], 7)[0].tolist() for p in prompts]
    attention = sum(not layer.keeps_state for layer in lm.decoder.layers)
    cache = PagedKVCache(attention, page_size=3)
    got = generate_batch(lm, prompts, 7, cache=cache)
    assert [t.tolist() for t in got] == alone
    assert cache.sequences == [] and cache.pages_in_use == 0
    joined = generate_batch(lm, prompts, 7, max_batch=2)  # prompts join as others end
    assert [t.tolist() for t in joined] == alone


def test_a_plan_of_state_layers_only_needs_no_paged_cache():
    lm = _lm([_mean, "gated_deltanet"])
    prompts = _prompts((3, 1, 5))
    alone = [lm.generate(p[None], 6)[0].tolist() for p in prompts]
    eos = alone[0][4]
    want = []
    for t, p in zip(alone, prompts, strict=True):
        new = t[len(p) :]
        want.append(t[: len(p) + (new.index(eos) + 1 if eos in new else len(new))])
    got = generate_batch(lm, prompts, 6, eos_token_id=eos, max_batch=2)
    assert [t.tolist() for t in got] == want
    with pytest.raises(ValueError, match=r"PagedKVCache with 0 layers \(one per attention layer"):
        generate_batch(lm, prompts, 2, cache=PagedKVCache(2))


def test_a_paged_cache_has_one_layer_per_attention_layer():
    lm = _lm("1 gated_deltanet : 1 full", num_layers=4)
    with pytest.raises(ValueError, match=r"PagedKVCache with 2 layers \(one per attention layer"):
        generate_batch(lm, _prompts(), 2, cache=PagedKVCache(4))


def test_a_mixer_that_is_not_causal_is_refused_when_the_model_is_built():
    with pytest.raises(ValueError, match=r"layer 1's token mixer _Bidirectional does not mix"):
        DecoderLM(V, 8, 2, ["full", lambda embed_dim, **_: _Bidirectional(embed_dim)], max_len=8)


def test_lightning_layers_learn_their_place_in_the_stack():
    lm = DecoderLM(V, 8, 2, "1 lightning : 1 mixer.lightning", num_layers=4, max_len=8)
    places = [
        (part.layer_idx, part.num_layers)
        for part in lm.modules()
        if isinstance(part, ak.linear_family.lightning.LightningAttention)
    ]
    assert places == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_the_stacks_gate_reaches_its_full_layers_only():
    """gate= shapes the self-attention of the full layers; the mixer layers take no slot."""
    plan, kw = PLANS["qwen3_next-like"]
    lm = _lm(plan, **kw)
    full = [b.self_attention for b in lm.decoder.layers if b.mixer is None]
    mixers = [b.mixer for b in lm.decoder.layers if b.mixer is not None]
    assert len(full) == 1 and len(mixers) == 3
    mha = getattr(full[0], "module", full[0])
    assert mha.gate is not None and mha.gate.kind == "elementwise"
