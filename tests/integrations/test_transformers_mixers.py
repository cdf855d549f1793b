"""swap_mixers against the transformers hybrid models it swaps, small and random in float64: the
swapped model's logits (with and without padding), its cached decoding and greedy generation
equal the original's, and the transformers cache holds what the original's holds. The originals
run with their float32 casts widened (tests/mixers/hf_float64.py), so that both sides compute in
float64."""

import copy
import sys

import pytest
import torch
import transformers
from mixers.hf_float64 import widened
from transformers import AutoConfig, AutoModelForCausalLM

from attnkit.integrations.transformers import swap_attention
from attnkit.integrations.transformers_mixers import (
    NOT_EXACT,
    SUPPORTED,
    TransformersMixer,
    swap_mixers,
)
from attnkit.mixers import GatedDeltaNetMixer, Mamba2Mixer

TOL = {"rtol": 1e-10, "atol": 1e-10}
VOCAB = 48
_ATTN = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
_MAMBA = {"mamba_d_state": 6, "mamba_n_groups": 2, "mamba_expand": 2}
CONFIGS = {
    "mamba2": {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "num_heads": 4,
        "head_dim": 8,
        "state_size": 6,
        "n_groups": 2,
        "expand": 2,
        "chunk_size": 5,
        "num_hidden_layers": 2,
        "pad_token_id": 0,
    },
    "bamba": _ATTN
    | _MAMBA
    | {
        "num_hidden_layers": 2,
        "attn_layer_indices": [1],
        "mamba_n_heads": 4,
        "mamba_d_head": 8,
        "mamba_chunk_size": 5,
    },
    "granitemoehybrid": _ATTN
    | _MAMBA
    | {
        "num_hidden_layers": 2,
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 4,
        "mamba_d_head": 8,
        "mamba_chunk_size": 5,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
    },
    "nemotron_h": _ATTN
    | {
        "num_hidden_layers": 3,
        "layers_block_type": ["mamba", "attention", "mlp"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "ssm_state_size": 6,
        "n_groups": 2,
        "chunk_size": 5,
    },
    "zamba2": _ATTN
    | {
        "num_hidden_layers": 2,
        "layers_block_type": ["mamba", "hybrid"],
        "n_mamba_heads": 4,
        "mamba_headdim": 8,
        "mamba_d_state": 6,
        "mamba_ngroups": 2,
        "mamba_expand": 2,
        "chunk_size": 5,
        "num_mem_blocks": 1,
    },
    "qwen3_next": _ATTN
    | {
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 6,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 8,
    },
    "qwen3_5_text": _ATTN
    | {
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 6,
    },
    "qwen3_5_moe_text": _ATTN
    | {
        "num_hidden_layers": 2,
        "layer_types": ["full_attention", "linear_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 6,
        "linear_value_head_dim": 8,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 8,
    },
    "kimi_linear": _ATTN
    | {
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "dense"],
        "linear_head_dim": 8,
        "linear_num_heads": 2,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
    },
    "minimax": _ATTN
    | {
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "block_size": 4,
    },
}
#: The linear layer class each model holds.
LAYERS = {
    "mamba2": "Mamba2Mixer",
    "bamba": "BambaMixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "nemotron_h": "NemotronHMamba2Mixer",
    "zamba2": "Zamba2MambaMixer",
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "qwen3_5_moe_text": "Qwen3_5MoeGatedDeltaNet",
    "kimi_linear": "KimiLinearDeltaAttention",
    "minimax": "MiniMaxLightningAttention",
}


def modeling(model):
    """The transformers module file that defines ``model``'s layers."""
    return sys.modules[type(model).__module__]


def build(model_type, extra=None, seed=0):
    """The small model in float64 (built with float64 as the default dtype, so that buffers
    computed at construction — MiniMax's decays — are float64 too), every weight perturbed."""
    config = AutoConfig.for_model(model_type, **(CONFIGS[model_type] | (extra or {})))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    default = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float64)
    try:
        transformers.logging.set_verbosity_error()
        model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(default)
        transformers.logging.set_verbosity_warning()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    """(model type, original, swapped copy)."""
    original = build(request.param)
    swapped = copy.deepcopy(original)
    swap_mixers(swapped)
    return request.param, original, swapped


def adapters(model):
    return [n for n, m in model.named_modules() if isinstance(m, TransformersMixer)]


def inputs(left=0, right=0, n=9):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, n), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :left] = 0
    mask[1, n - right :] = 0
    return ids, mask


def test_every_linear_layer_is_replaced(pair):
    model_type, original, swapped = pair
    layers = [n for n, m in original.named_modules() if type(m).__name__ == LAYERS[model_type]]
    assert layers
    for name in layers:
        adapter = swapped.get_submodule(name)
        assert isinstance(adapter, TransformersMixer)
        assert adapter.source == LAYERS[model_type]
        assert adapter.layer_idx == original.get_submodule(name).layer_idx
    left = [m for m in swapped.modules() if type(m).__module__.startswith("transformers.")]
    assert not any(type(m).__name__ in SUPPORTED for m in left)
    with pytest.raises(ValueError, match="no linear token-mixer layer"):
        swap_mixers(swapped)  # attnkit's own mixers are not swapped again


@pytest.mark.parametrize(("left", "right"), [(0, 0), (3, 0), (0, 4)])
def test_logits_equal_the_original(pair, left, right):
    """Without padding, left-padded (every position, padding included) and right-padded (the
    real positions)."""
    _model_type, original, swapped = pair
    ids, mask = inputs(left, right)
    kwargs = {} if left == right == 0 else {"attention_mask": mask}
    with torch.no_grad(), widened(modeling(original)):
        expected = original(ids, **kwargs).logits
        got = swapped(ids, **kwargs).logits
    keep = mask.bool() if right else torch.ones_like(mask, dtype=torch.bool)
    torch.testing.assert_close(got[keep], expected[keep], **TOL)


def decode(model, ids, mask, steps):
    """Prefill, then ``steps`` greedy steps one token at a time through the cache: the logits
    of every step, the tokens, and the cache."""
    out = model(ids, attention_mask=mask, use_cache=True)
    cache = out.past_key_values
    logits = [out.logits[:, -1]]
    tokens = ids
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], 1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out = model(nxt, attention_mask=mask, cache=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1), tokens, cache


@pytest.mark.parametrize("left", [0, 3])
def test_cached_decoding_equals_the_original(pair, left):
    _model_type, original, swapped = pair
    ids, mask = inputs(left)
    with torch.no_grad(), widened(modeling(original)):
        expected, tokens, _ = decode(original, ids, mask, 4)
        got, got_tokens, _ = decode(swapped, ids, mask, 4)
    assert torch.equal(got_tokens, tokens)
    torch.testing.assert_close(got, expected, **TOL)


def test_the_cache_holds_what_the_original_keeps(pair):
    """After a left-padded prefill and two steps, the transformers cache's states of each linear
    layer equal those the original model wrote."""
    model_type, original, swapped = pair
    ids, mask = inputs(2)
    with torch.no_grad(), widened(modeling(original)):
        _, _, theirs = decode(original, ids, mask, 2)
        _, _, ours = decode(swapped, ids, mask, 2)
    layers = [m.layer_idx for m in swapped.modules() if isinstance(m, TransformersMixer)]
    for i in layers:
        if model_type == "minimax":
            torch.testing.assert_close(ours.get_linear_cache(i), theirs.get_linear_cache(i), **TOL)
            continue
        torch.testing.assert_close(ours.get_conv_state(i), theirs.get_conv_state(i), **TOL)
        state = ours.get_recurrent_state(i)
        torch.testing.assert_close(state, theirs.get_recurrent_state(i).to(state.dtype), **TOL)


def test_greedy_generate_gives_the_same_tokens(pair):
    _model_type, original, swapped = pair
    ids, mask = inputs(2)
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "attention_mask": mask}
    with torch.no_grad(), widened(modeling(original)):
        expected = original.generate(ids, **kwargs)
        got = swapped.generate(ids, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("model_type", ["bamba", "kimi_linear"])
def test_beam_search_reorders_the_states_it_reads(model_type):
    """Beam search reorders transformers' cache between steps; the swapped layers read the
    reordered states, so the beams equal the original's."""
    original = build(model_type, seed=7)
    swapped = copy.deepcopy(original)
    swap_mixers(swapped)
    ids, mask = inputs(2, n=6)
    kwargs = {"max_new_tokens": 4, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), widened(modeling(original)):
        expected = original.generate(ids, attention_mask=mask, **kwargs)
        got = swapped.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, expected)


def test_the_weights_are_copies(pair):
    """The adapter's mixer holds copies: the original's parameters are not shared, changing them
    leaves the swapped model as it was; the state dict names the mixer's parameters."""
    _, original, swapped = pair
    ours = {p.data_ptr() for p in swapped.parameters()}
    theirs = {
        p.data_ptr()
        for name in adapters(swapped)
        for p in original.get_submodule(name).parameters()
    }
    assert not ours & theirs
    keys = [k for k in swapped.state_dict() if ".mixer." in k or k.startswith("mixer.")]
    assert all(any(k.startswith(f"{a}.mixer.") for k in keys) for a in adapters(swapped))
    for name in adapters(swapped):
        count = sum(p.numel() for p in original.get_submodule(name).parameters())
        assert sum(p.numel() for p in swapped.get_submodule(name).parameters()) == count


def test_saving_the_swapped_model_is_refused(pair, tmp_path):
    """transformers could not load the mixers' weights: save_pretrained says so."""
    *_, swapped = pair
    with pytest.raises(ValueError, match="save the original model"):
        swapped.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())


def test_gradients_equal_the_original():
    """Training through the swapped model: the gradients with respect to the input embeddings
    and to the layers around the mixers equal the original's; the mixer's own parameters get
    gradients (its weights are its own copies)."""
    model = build("qwen3_next", seed=6)
    swapped = copy.deepcopy(model)
    swap_mixers(swapped)
    ids, mask = inputs(2)
    grads = []
    for m in (model, swapped):
        embeds = m.get_input_embeddings()(ids).detach().requires_grad_()
        with widened(modeling(model)):
            m(inputs_embeds=embeds, attention_mask=mask).logits[mask.bool()].pow(2).sum().backward()
        grads.append((embeds.grad, m.lm_head.weight.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], **TOL)
    torch.testing.assert_close(grads[1][1], grads[0][1], **TOL)
    mixer = swapped.model.layers[0].linear_attn.mixer
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mixer.parameters())
    assert "_attnkit_input" not in mixer.conv.__dict__  # nothing kept after a call


def test_a_chunk_size_override_changes_nothing():
    model = build("qwen3_next", seed=1)
    swapped = copy.deepcopy(model)
    swap_mixers(swapped, chunk_size=2)
    ids, mask = inputs(3)
    with torch.no_grad(), widened(modeling(model)):
        torch.testing.assert_close(
            swapped(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits, **TOL
        )
    assert swapped.model.layers[0].linear_attn.mixer.chunk_size == 2


def test_with_swap_attention_the_whole_model_is_attnkit():
    model = build("qwen3_next", seed=2)
    swapped = copy.deepcopy(model)
    swap_mixers(swapped)
    swap_attention(swapped)
    ids, mask = inputs(2)
    with torch.no_grad(), widened(modeling(model)):
        expected, tokens, _ = decode(model, ids, mask, 3)
        got, got_tokens, _ = decode(swapped, ids, mask, 3)
    assert torch.equal(got_tokens, tokens)
    torch.testing.assert_close(got, expected, **TOL)


def test_another_mixer_decodes_from_its_own_cache():
    """A mixer of another kind (a fresh Gated DeltaNet layer in a Mamba-2 model) keeps its
    MixerCache beside transformers' cache: cached decoding equals the uncached pass."""
    model = build("mamba2", seed=3)

    def fresh(module):
        torch.manual_seed(4)
        return GatedDeltaNetMixer(16, 2, 8, dtype=torch.float64)

    names = swap_mixers(model, mixer=fresh)
    assert all(isinstance(model.get_submodule(n).mixer, GatedDeltaNetMixer) for n in names)
    ids, mask = inputs()
    with torch.no_grad():
        steps, tokens, cache = decode(model, ids, mask, 3)
        full = model(tokens).logits
    assert sorted(cache.attnkit_mixer_caches) == [0, 1]
    torch.testing.assert_close(steps, full[:, ids.shape[1] - 1 :], **TOL)


def test_a_mixer_by_name_or_class():
    model = build("mamba2", seed=5)
    reference = copy.deepcopy(model)
    swap_mixers(model, mixer="mamba2", chunk_size=3)
    assert all(m.mixer.chunk_size == 3 for m in model.modules() if isinstance(m, TransformersMixer))
    ids, _ = inputs()
    with torch.no_grad(), widened(modeling(reference)):
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **TOL)
    with pytest.raises(ValueError, match="GatedDeltaNetMixer cannot be built from Mamba2Mixer"):
        swap_mixers(copy.deepcopy(reference), mixer=GatedDeltaNetMixer)
    with pytest.raises(TypeError, match="mixer must be"):
        swap_mixers(copy.deepcopy(reference), mixer=3)
    with pytest.raises(TypeError, match="keyword arguments"):
        swap_mixers(copy.deepcopy(reference), mixer=lambda m: Mamba2Mixer(16, 4), chunk_size=3)


def test_refused_by_name():
    jamba = AutoConfig.for_model(
        "jamba",
        **_ATTN,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        num_experts=2,
        mamba_d_state=4,
    )
    model = AutoModelForCausalLM.from_config(jamba)
    with pytest.raises(ValueError, match=r"JambaMambaMixer \(.*Mamba-1"):
        swap_mixers(model)
    assert type(model.model.layers[0].mamba).__name__ == "JambaMambaMixer"  # left as it was
    assert "FalconH1Mixer" in NOT_EXACT and "ssm_in_multiplier" in NOT_EXACT["FalconH1Mixer"]


def test_a_model_without_linear_layers_is_refused():
    config = AutoConfig.for_model("llama", **_ATTN, num_hidden_layers=1)
    with pytest.raises(ValueError, match="no linear token-mixer layer"):
        swap_mixers(AutoModelForCausalLM.from_config(config))
    with pytest.raises(TypeError, match="model must be"):
        swap_mixers("model")
