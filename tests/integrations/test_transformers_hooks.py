"""Named hook points of a swapped transformers model against the eager model edited by hand."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import BertConfig, BertModel

import attnkit as ak
from attnkit.integrations.transformers import swap_attention

transformers.logging.set_verbosity_error()

H, D = 4, 4
SELF = "encoder.layer.{}.attention.self"


def _bert() -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40,
        hidden_size=H * D,
        num_hidden_layers=2,
        num_attention_heads=H,
        intermediate_size=32,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    return BertModel(config).double().eval()


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(seed))


def _eager_with(model: BertModel, ids: torch.Tensor, layer: int, edit) -> torch.Tensor:
    """The eager model with ``edit(context (B, N, H·d)) -> context`` applied by a forward hook
    to layer ``layer``'s self-attention output (its heads side by side, before W^O)."""
    module = model.get_submodule(SELF.format(layer))
    handle = module.register_forward_hook(lambda m, args, out: (edit(out[0]), *out[1:]))
    try:
        return model(ids).last_hidden_state
    finally:
        handle.remove()


def test_recorded_points_equal_the_eager_model():
    model = _bert()
    ids = _ids(1)
    hidden = {}
    handle = model.embeddings.register_forward_hook(lambda m, a, out: hidden.setdefault("x", out))
    eager = model(ids, output_attentions=True)
    handle.remove()
    swap_attention(model)
    with ak.hooks.record(model) as cache:
        out = model(ids).last_hidden_state
    torch.testing.assert_close(out, eager.last_hidden_state)
    attn = model.get_submodule(SELF.format(0))
    x = hidden["x"]
    for point, proj in (("q", attn.query), ("k", attn.key), ("v", attn.value)):
        want = proj(x).view(2, 7, H, D).transpose(1, 2)
        torch.testing.assert_close(cache[f"{SELF.format(0)}.{point}"], want)
    for i in range(2):
        torch.testing.assert_close(cache[f"{SELF.format(i)}.weights"], eager.attentions[i])
    ctx = cache[f"{SELF.format(1)}.context"]
    torch.testing.assert_close(cache[f"{SELF.format(1)}.output"], ctx.transpose(1, 2).flatten(2))


def test_patching_a_heads_context_to_another_inputs_equals_the_eager_model_by_hand():
    model = _bert()
    x1, x2, head = _ids(1), _ids(2), 2
    cols = slice(head * D, (head + 1) * D)
    seen = {}
    _eager_with(model, x2, 1, lambda c: seen.setdefault("c", c))

    def place(c):
        c = c.clone()
        c[..., cols] = seen["c"][..., cols]
        return c

    want = _eager_with(model, x1, 1, place)
    swap_attention(model)
    name = f"{SELF.format(1)}.context"
    with ak.hooks.record(model, names=name) as cache:
        model(x2)
    with ak.hooks.patch(model, {name: ak.hooks.replace_heads(cache[name], head)}):
        got = model(x1).last_hidden_state
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, model(x1).last_hidden_state)


def test_head_ablation_equals_the_eager_model_by_hand():
    model = _bert()
    ids = _ids(3)

    def zero(c):
        c = c.clone()
        c[..., 1 * D : 2 * D] = 0.0
        return c

    want = _eager_with(model, ids, 0, zero)
    swap_attention(model, align="softmax")
    with ak.hooks.ablate_heads(model, {SELF.format(0): [1]}):
        got = model(ids).last_hidden_state
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("align", ["softmax", "sparsemax"])
def test_knocking_out_a_key_for_every_query_equals_padding_it_in_one_layer(align):
    model = _bert()
    swap_attention(model, align=align)
    ids = _ids(4)
    n = ids.shape[1]
    # Knock out key 5 in every layer, for every query: the same as padding token 5 (which
    # masks it as a key in every layer; queries at padding still run).
    links = {SELF.format(i): [(q, 5) for q in range(n)] for i in range(2)}
    with ak.hooks.knock_out(model, links):
        got = model(ids).last_hidden_state
    mask = torch.ones_like(ids)
    mask[:, 5] = 0
    torch.testing.assert_close(got, model(ids, attention_mask=mask).last_hidden_state)
