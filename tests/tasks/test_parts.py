"""Parts from names: every score gets exactly its listed sizes, and nothing is guessed."""

import pytest
import torch

import attnkit as ak
from attnkit.tasks import parts


def test_every_registered_score_is_usable_or_refused_by_name():
    for name in ak.scores.available():
        if name in parts.usable_scores():
            score = parts.build_score(name, d_q=6, d_k=6, d_w=5, max_len=9)
            assert score.registered_name == name
        else:
            with pytest.raises(ValueError, match=f"score {name!r} is registered but"):
                parts.build_score(name, d_q=6, d_k=6, d_w=5, max_len=9)


def test_sizes_reach_the_score():
    additive = parts.build_score("additive", d_q=6, d_k=7, d_w=5, max_len=9)
    assert (additive.d_q, additive.d_k, additive.d_w) == (6, 7, 5)
    location = parts.build_score("location", d_q=6, d_k=6, d_w=5, max_len=9)
    assert location.max_len == 9 and location.d_q == 6


def test_a_score_missing_from_the_table_is_refused(monkeypatch):
    monkeypatch.delitem(parts.SCORE_SIZES, "general")
    with pytest.raises(ValueError, match="add it to SCORE_SIZES"):
        parts.build_score("general", d_q=4, d_k=4, d_w=4, max_len=4)
    assert "general" not in parts.usable_scores()


def test_unknown_names_name_the_closest():
    with pytest.raises(ValueError, match="did you mean 'additive'"):
        parts.build_score("additve", d_q=4, d_k=4, d_w=4, max_len=4)
    with pytest.raises(ValueError, match="did you mean 'softmax'"):
        parts.build_alignment("softmx", 4)


def test_an_alignment_that_needs_arguments_is_refused_clearly(monkeypatch):
    monkeypatch.delitem(parts.ALIGNMENT_ARGUMENTS, "local")
    with pytest.raises(ValueError, match="alignment 'local' cannot be built by attnkit run"):
        parts.build_alignment("local", 4)


@pytest.mark.parametrize("align", ak.alignments.available())
def test_every_alignment_builds_and_attends(align):
    attention = parts.build_attention("general", align, 4, 6)
    out = attention(torch.randn(2, 1, 4), torch.randn(2, 6, 4), need_weights=True)
    assert out.context.shape == (2, 1, 4)


def test_reinforce_term_only_for_stochastic_alignments():
    per_item = torch.tensor([1.0, 3.0])
    assert parts.task_loss(per_item, None) == 2.0
    log_prob = torch.tensor([0.0, -1.0], requires_grad=True)
    loss = parts.task_loss(per_item, log_prob)
    loss.backward()
    # reward - baseline = (-1 - -2, -3 - -2) = (1, -1); d/dlog_prob = -(reward - mean) / 2
    torch.testing.assert_close(log_prob.grad, torch.tensor([-0.5, 0.5]))


def test_slot_mechanisms_by_registry_and_built_with_the_model_sizes():
    names = parts.slot_mechanisms("attnkit.efficient")
    assert {"linear", "performer", "rfa"} <= set(names)
    assert "memn2n" not in parts.slot_mechanisms()  # not a per-head attention part
    performer = parts.build_slot_attention("performer", head_dim=8, num_heads=2, max_len=16)
    assert performer.d == 8 and performer.omega.shape[-1] == 8


def test_build_slot_attention_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="not a per-head attention part"):
        parts.build_slot_attention("memn2n", head_dim=8, num_heads=2, max_len=16)
    with pytest.raises(ValueError, match="unknown mechanism"):
        parts.build_slot_attention("nope", head_dim=8, num_heads=2, max_len=16)


def test_a_mechanism_needing_an_argument_nothing_makes_is_refused(monkeypatch):
    monkeypatch.delitem(parts.SLOT_ARGUMENTS, "synthesizer")
    with pytest.raises(ValueError, match="needs the argument 'components'"):
        parts.build_slot_attention("synthesizer", head_dim=8, num_heads=2, max_len=16)


@pytest.mark.parametrize("name", parts.slot_mechanisms())
def test_every_slot_mechanism_is_built_from_the_sizes_and_attends(name):
    torch.manual_seed(0)
    part = parts.build_slot_attention(name, head_dim=8, num_heads=2, max_len=16)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    context = part(q, k, v).context
    assert context.shape == (1, 2, 16, 8) and torch.isfinite(context).all()


def test_the_synthesizer_is_tays_dense_synthesizer_per_head():
    from attnkit.efficient.synthesizer import DenseSynthetic

    part = parts.build_slot_attention("synthesizer", head_dim=8, num_heads=2, max_len=16)
    (component,) = part.components
    assert isinstance(component, DenseSynthetic)
    assert component.heads == 2 and component.max_len == 16
