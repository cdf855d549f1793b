"""Parts from names: each registered part builds itself at the model's sizes (its class's
``for_heads``), and what the sizes cannot give is refused by name, never guessed."""

from typing import ClassVar

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.registry import Registry
from attnkit.tasks import parts


@pytest.fixture
def registries():
    """Every registry as it was before the test (a test may register parts)."""
    saved = [(r, r.snapshot()) for r in list(Registry.instances)]
    yield
    for registry, table in saved:
        registry.restore(table)


def test_every_registered_score_is_built_by_its_class():
    assert parts.usable_scores() == ak.scores.available()
    for name in ak.scores.available():
        score = parts.build_score(name, head_dim=6, max_len=9)
        assert score.registered_name == name and score.num_heads is None
        per_head = parts.build_score(name, head_dim=6, max_len=9, num_heads=2)
        # a score with parameters holds one set per head; one without has nothing to split
        assert per_head.num_heads == 2 or not list(per_head.parameters()), name


def test_sizes_and_overrides_reach_the_score():
    additive = parts.build_score("additive", head_dim=6, max_len=9)
    assert (additive.d_q, additive.d_k, additive.d_w) == (6, 6, 6)
    additive = parts.build_score("additive", head_dim=6, max_len=9, d_k=7, d_w=5)
    assert (additive.d_q, additive.d_k, additive.d_w) == (6, 7, 5)
    location = parts.build_score("location", head_dim=6, max_len=9)
    assert location.max_len == 9 and location.d_q == 6
    with pytest.raises(TypeError, match="score 'dot' got an unexpected argument 'd_w'"):
        parts.build_score("dot", head_dim=6, max_len=9, d_w=5)


def test_a_score_needing_what_no_size_gives_is_refused_by_name(registries):
    @ak.scores.REGISTRY.register("needs_width")
    class NeedsWidth(ak.scores.Dot):
        size_arguments = {"d": "head_dim"}  # noqa: RUF012

        def __init__(self, d: int, width: int) -> None:
            super().__init__()

    with pytest.raises(TypeError, match="score 'needs_width' needs the argument 'width'"):
        parts.build_score("needs_width", head_dim=4, max_len=4)
    assert parts.build_score("needs_width", head_dim=4, max_len=4, width=3).registered_name == (
        "needs_width"
    )


def test_unknown_names_name_the_closest():
    with pytest.raises(ValueError, match="did you mean 'additive'"):
        parts.build_score("additve", head_dim=4, max_len=4)
    with pytest.raises(ValueError, match="did you mean 'softmax'"):
        parts.build_alignment("softmx", 4)


def test_alignments_are_built_by_their_class_and_refused_clearly(registries):
    local = parts.build_alignment("local", 6)
    assert (local.position, local.window, local.W_p.d_in) == ("predictive", 2, 6)
    assert parts.build_alignment("query_temperature", 6, num_heads=2).predictor.num_heads == 2

    @ak.alignments.REGISTRY.register("needs_scale")
    class NeedsScale(ak.alignments.Softmax):
        def __init__(self, scale: float) -> None:
            super().__init__()

    with pytest.raises(ValueError, match=r"'needs_scale' cannot be built by attnkit run.*'scale'"):
        parts.build_alignment("needs_scale", 4)


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
    assert performer.head_dim == 8 and performer.omega.shape[-1] == 8


def test_build_slot_attention_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="not a per-head attention part"):
        parts.build_slot_attention("memn2n", head_dim=8, num_heads=2, max_len=16)
    with pytest.raises(ValueError, match="unknown per-head part"):
        parts.build_slot_attention("nope", head_dim=8, num_heads=2, max_len=16)


class _PlainPart(nn.Module):
    """A module with the old slot signature that is not an attnkit.head.HeadAttention."""

    def __init__(self, d: int, n: int = 1, alpha: float = 1.0) -> None:
        super().__init__()
        self.d, self.n, self.alpha = d, n, alpha

    def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
        return ak.attention(q, k, v, mask=mask, bias=bias, need_weights=need_weights)


class _HeadPart(ak.HeadAttention):
    """A per-head part whose declared sizes the base's ``for_heads`` fills."""

    size_arguments: ClassVar[dict[str, str]] = {"d": "head_dim"}

    def __init__(self, d: int, n: int = 1, alpha: float = 1.0) -> None:
        super().__init__()
        self.d, self.n, self.alpha = d, n, alpha

    def forward(self, q, k, v, **kwargs):
        return ak.attention(q, k, v)


def test_a_module_that_is_not_a_head_part_is_refused(registries):
    ak.mechanisms.available()
    ak.mechanisms.REGISTRY.register("plain_part")(_PlainPart)
    assert "plain_part" not in parts.slot_mechanisms()
    with pytest.raises(ValueError, match="'plain_part' is not a per-head attention part"):
        parts.build_slot_attention("plain_part", head_dim=8, num_heads=2, max_len=16)


def test_a_head_part_is_built_by_its_for_heads_and_refused_when_it_cannot_be(registries):
    ak.mechanisms.available()
    ak.head_registry.REGISTRY.register("head_part")(_HeadPart)
    part = parts.build_slot_attention("head_part", head_dim=8, num_heads=2, max_len=16)
    assert (part.d, part.alpha) == (8, 1.0)

    class Needy(_HeadPart):
        def __init__(self, d: int, alpha: float) -> None:
            super().__init__(d, alpha=alpha)

    ak.head_registry.REGISTRY.register("needy_part")(Needy)
    with pytest.raises(ValueError, match="'needy_part' cannot be built from the model's sizes"):
        parts.build_slot_attention("needy_part", head_dim=8, num_heads=2, max_len=16)

    class Refusing(_HeadPart):
        @classmethod
        def for_heads(cls, *, embed_dim, num_heads, head_dim, max_len, **overrides):
            raise TypeError("Refusing.for_heads: the argument 'alpha' cannot be filled")

    ak.head_registry.REGISTRY.register("refusing_part")(Refusing)
    with pytest.raises(ValueError, match="'refusing_part' cannot be built from the model's sizes"):
        parts.build_slot_attention("refusing_part", head_dim=8, num_heads=2, max_len=16)


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
    assert component.num_heads == 2 and component.max_len == 16


NEW_SCORE = '''
"""A score defined outside attnkit, registered in this one file and nowhere else."""

import math

import torch

import attnkit as ak
from attnkit import taxonomy as tx


@ak.scores.REGISTRY.register("bilinear_one_file")
class BilinearOneFile(ak.scores.Score):
    """e_l = qᵀ W k_l / √d, one W per head."""

    scoring = tx.Scoring.GENERAL
    size_arguments = {"d": "head_dim", "num_heads": "num_heads"}

    def __init__(self, d, *, num_heads=None, device=None, dtype=None):
        super().__init__()
        self.d, self.num_heads = d, num_heads
        shape = (d, d) if num_heads is None else (num_heads, d, d)
        self.W = torch.nn.Parameter(torch.randn(shape, device=device, dtype=dtype) / d)

    def project_query(self, q):
        return q @ self.W

    def pairwise(self, qp, kp, key_offset=0):
        return qp @ kp.transpose(-1, -2) / math.sqrt(self.d)
'''


def test_a_score_registered_in_one_file_reaches_run_the_contract_suites_and_the_kernels(
    tmp_path, registries, monkeypatch
):
    import importlib.util
    import sys

    import registered_parts as rp

    from attnkit import cli
    from attnkit.kernels import chunked, dense

    path = tmp_path / "bilinear_one_file.py"
    path.write_text(NEW_SCORE)
    spec = importlib.util.spec_from_file_location("bilinear_one_file", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bilinear_one_file", module)
    spec.loader.exec_module(module)

    # attnkit run --score NAME: the parser, the configuration check and a tiny run (without
    # drawing the HTML report's figures, which take seconds and read no score)
    from attnkit.experiments import runner

    monkeypatch.setattr(runner, "write_report", lambda run_dir, *_, **__: run_dir / "report.html")
    argv = ["run", "sort", "--score", "bilinear_one_file", "--out", str(tmp_path / "run")]
    argv += ["--n-train", "32", "--n-test", "8", "--batch-size", "32", "--d-model", "8"]
    argv += ["--epochs", "1", "--no-progress", "--threads", "1"]
    assert cli.main(argv) == 0
    assert '"score": "bilinear_one_file"' in (tmp_path / "run" / "config.json").read_text()

    # the contract suites' parts: found by walking the registry, built by the class's example
    assert "bilinear_one_file" in rp.score_examples()
    att = rp.build_attention("bilinear_one_file", "softmax")
    q, k, v = rp.inputs(requires_grad=True)
    out = att(q, k, v, need_weights=True)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda q, k, v: att(q, k, v).context, (q, k, v))

    # the chunked kernel equals the dense one, and multi-head attention builds it per head
    s = rp.score_examples()["bilinear_one_file"](rp.Dims()).double()
    a = ak.alignments.Softmax()
    ref = dense.attend(q, k, v, s, a, need_weights=True)
    got = chunked.attend(q, k, v, s, a, need_weights=True, chunk_size=2)
    torch.testing.assert_close(got.context, ref.context)
    mha = ak.MultiHeadAttention(8, 2, score="bilinear_one_file")
    assert mha.score.W.shape == (2, 4, 4)
    assert mha(torch.randn(1, 5, 8)).context.shape == (1, 5, 8)
    # its num_heads is read by the score's input check: inputs without the head dim are refused
    with pytest.raises(ValueError, match="built with num_heads=2"):
        mha.score(torch.randn(2, 5, 4), torch.randn(2, 5, 4))
