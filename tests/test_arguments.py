"""Constructor argument helpers: the one spelling of sizes (DESIGN 8) and the validators."""

from __future__ import annotations

import inspect
import warnings

import pytest

from attnkit import arguments
from attnkit.arguments import deprecated_names, renamed


@renamed(d_model="embed_dim", heads="num_heads")
class Layer:
    def __init__(self, embed_dim: int, num_heads: int = 2, *, dropout: float = 0.0) -> None:
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout


class Child(Layer):
    pass


@renamed(d="head_dim")
def head_size(head_dim: int, scale: float = 1.0) -> float:
    return head_dim * scale


def test_old_keyword_raises_type_error_naming_the_new_one() -> None:
    with pytest.raises(TypeError, match=r"^Layer: `heads` is now `num_heads`$"):
        Layer(8, heads=2)
    with pytest.raises(TypeError, match=r"^Layer: `d_model` is now `embed_dim`$"):
        Layer(d_model=8)
    with pytest.raises(TypeError, match=r"^head_size: `d` is now `head_dim`$"):
        head_size(d=4)


def test_message_names_the_class_that_was_called() -> None:
    with pytest.raises(TypeError, match=r"^Child: `heads` is now `num_heads`$"):
        Child(8, heads=2)


def test_positional_and_new_keywords_pass_through() -> None:
    a, b = Layer(8, 4), Layer(embed_dim=8, num_heads=4, dropout=0.5)
    assert (a.embed_dim, a.num_heads, a.dropout) == (8, 4, 0.0)
    assert (b.embed_dim, b.num_heads, b.dropout) == (8, 4, 0.5)
    assert head_size(3, 2.0) == 6.0 and head_size(head_dim=3) == 3.0


def test_signature_and_name_are_kept() -> None:
    assert list(inspect.signature(Layer).parameters) == ["embed_dim", "num_heads", "dropout"]
    assert list(inspect.signature(head_size).parameters) == ["head_dim", "scale"]
    assert head_size.__name__ == "head_size" and Layer.__init__.__name__ == "__init__"


def test_decorating_again_merges_the_tables() -> None:
    @renamed(n_heads="num_heads")
    class Again(Layer):
        pass

    for old, new in [("n_heads", "num_heads"), ("heads", "num_heads"), ("d_model", "embed_dim")]:
        with pytest.raises(TypeError, match=f"Again: `{old}` is now `{new}`"):
            Again(8, **{old: 2})
    assert Again(8, num_heads=3).num_heads == 3


def test_bad_renames_are_refused_at_decoration() -> None:
    with pytest.raises(TypeError, match="still takes 'heads'"):

        @renamed(heads="num_heads")
        def still(heads: int, num_heads: int) -> None: ...

    with pytest.raises(TypeError, match="no parameter 'num_heads'"):

        @renamed(heads="num_heads")
        def missing(embed_dim: int) -> None: ...

    with pytest.raises(TypeError, match="must be an identifier"):
        renamed(heads=3)  # type: ignore[arg-type]


@deprecated_names(d="head_dim")
@renamed(heads="num_heads")
class Part:
    def __init__(self, head_dim: int, num_heads: int = 1, *, scale: float = 1.0) -> None:
        self.head_dim, self.num_heads, self.scale = head_dim, num_heads, scale


class ChildPart(Part):
    pass


@deprecated_names(dim="head_dim")
def doubled(head_dim: int, extra: int = 0) -> int:
    return 2 * head_dim + extra


def test_deprecated_keyword_warns_naming_the_new_one_and_still_works() -> None:
    with pytest.warns(DeprecationWarning, match=r"^Part: d= is renamed head_dim=; d= will be"):
        old = Part(d=4, num_heads=2)
    new = Part(head_dim=4, num_heads=2)
    assert (old.head_dim, old.num_heads) == (new.head_dim, new.num_heads) == (4, 2)
    with pytest.warns(DeprecationWarning, match=r"^doubled: dim= is renamed head_dim="):
        assert doubled(dim=3, extra=1) == 7
    with pytest.warns(DeprecationWarning, match=r"^ChildPart: d= is renamed head_dim="):
        assert ChildPart(d=5).head_dim == 5


def test_deprecation_warning_points_at_the_caller() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        Part(d=4)
    assert caught[0].filename == __file__


def test_new_and_positional_spellings_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Part(4).head_dim == Part(head_dim=4).head_dim == 4
        assert doubled(3) == doubled(head_dim=3) == 6


def test_old_and_new_spelling_together_are_refused_by_name() -> None:
    both = r"^Part: got both `d` and `head_dim`; `d` is renamed `head_dim`, pass only `head_dim`$"
    with pytest.raises(TypeError, match=both):
        Part(d=4, head_dim=4)
    with pytest.raises(TypeError, match=both):  # the new parameter given by position
        Part(4, d=4)
    with pytest.raises(TypeError, match="got both `dim` and `head_dim`"):
        doubled(3, dim=3)


def test_deprecated_and_refused_names_live_on_one_wrapper() -> None:
    with pytest.raises(TypeError, match=r"^Part: `heads` is now `num_heads`$"):
        Part(4, heads=2)
    assert list(inspect.signature(Part).parameters) == ["head_dim", "num_heads", "scale"]
    assert Part.__init__.__deprecated_names__ == {"d": "head_dim"}
    assert Part.__init__.__renamed__ == {"heads": "num_heads"}
    assert Part.__init__.__renamed_wrapped__.__qualname__ == "Part.__init__"


def test_refusing_a_deprecated_name_later_ends_its_deprecation() -> None:
    @renamed(d="head_dim")
    class Removed(Part):
        pass

    with pytest.raises(TypeError, match=r"^Removed: `d` is now `head_dim`$"):
        Removed(d=4)
    assert Removed.__init__.__deprecated_names__ == {}
    with pytest.warns(DeprecationWarning):  # the parent is untouched
        Part(d=4)


def test_bad_deprecations_are_refused_at_decoration() -> None:
    with pytest.raises(TypeError, match="still takes 'd'"):

        @deprecated_names(d="head_dim")
        def still(d: int, head_dim: int) -> None: ...

    with pytest.raises(TypeError, match="no parameter 'head_dim'"):

        @deprecated_names(d="head_dim")
        def missing(embed_dim: int) -> None: ...

    with pytest.raises(TypeError, match="must be an identifier"):
        deprecated_names(d=None)  # type: ignore[arg-type]


def test_registry_build_accepts_a_deprecated_keyword_with_the_warning() -> None:
    from attnkit.registry import Registry

    reg = Registry("thing")
    reg.register("part")(Part)
    with pytest.warns(DeprecationWarning, match="d= is renamed head_dim="):
        part = reg.build("part", d=4, num_heads=2)
    assert (part.head_dim, part.num_heads) == (4, 2)
    with pytest.raises(TypeError, match=r"thing 'part': got both `d` and `head_dim`"):
        reg.build("part", d=4, head_dim=4)
    with pytest.raises(TypeError, match=r"thing 'part': `heads` is now `num_heads`"):
        reg.build("part", head_dim=4, heads=2)
    with pytest.raises(TypeError, match=r"thing 'part': missing a required argument: 'head_dim'"):
        reg.build("part", num_heads=2)


def test_validators_name_the_argument() -> None:
    assert arguments.positive_int(3, "num_heads") == 3
    with pytest.raises(ValueError, match="num_heads must be a positive int, got True"):
        arguments.positive_int(True, "num_heads")
    with pytest.raises(ValueError, match="max_len must be a positive int or None, got 0"):
        arguments.optional_positive_int(0, "max_len")
    assert arguments.optional_positive_int(None, "max_len") is None
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        arguments.probability(1.0)


def _renamed_public_callables():
    import attnkit as ak
    from attnkit import efficient as ef
    from attnkit import layers, qanet
    from attnkit.efficient import synthesizer
    from attnkit.memory import memn2n
    from attnkit.models import captioning, decoder_lm, masked_lm, seq2seq, universal, vit
    from attnkit.positions import gated_transformer_xl as gtxl
    from attnkit.positions import transformer_xl as txl
    from attnkit.sparse_trainable import dsa
    from attnkit.tasks import digits_task, long_range, mqar_task

    both = {"d_model": "embed_dim", "heads": "num_heads"}
    heads, width = {"heads": "num_heads"}, {"d_model": "embed_dim"}
    sc, al, sy = ak.scores, ak.alignments, synthesizer
    per_head = [
        sc.Additive, sc.Concat, sc.Deep, sc.Decomposable, sc.SharedDecomposable, sc.Hermitian,
        sc.DirectedHermitian, sc.General, sc.BiasedGeneral, sc.ActivatedGeneral, sc.Location,
        sc.Convolutional, sc.LearnedQuery, al.Local, al.PredictedWindow, al.QueryTemperature,
        ef.Linformer, ef.RelativeKernelAttention, sy.DenseSynthetic, sy.FactorizedDenseSynthetic,
        sy.RandomSynthetic, sy.FactorizedRandomSynthetic,
    ]  # fmt: skip
    spans = [ef.AdaptiveSpanAttention, ef.DynamicSpanAttention, ef.AdaptivelySparseAttention]
    return [
        (ak.TransformerEncoderLayer, both),
        (ak.TransformerDecoderLayer, both),
        (ak.TransformerEncoder, both),
        (ak.TransformerDecoder, both),
        (ak.Transformer, both),
        (decoder_lm.DecoderLM, both),
        (masked_lm.MaskedLM, both),
        (universal.UniversalTransformer, both),
        (universal.timestep_embedding, {"d": "embed_dim"}),
        (vit.ViT, both),
        (vit.PatchEmbedding, {"d_model": "embed_dim"}),
        (captioning.ImageCaptioner, {"d": "embed_dim"}),
        (seq2seq.Seq2SeqAttention, {"d": "embed_dim"}),
        (qanet.DepthwiseSeparableConv, {"d_model": "embed_dim"}),
        (qanet.QANetEncoderBlock, both),
        (qanet.QANetEncoder, both),
        (ak.vision.CrossCovarianceAttention, {"d_model": "embed_dim"}),
        (ak.queries.GatedHeadAttention, {"heads": "num_heads", "d_head": "head_dim"}),
        (txl.TransformerXLLayer, both),
        (txl.TransformerXL, both),
        (gtxl.GRUGate, {"d_model": "embed_dim"}),
        (gtxl.GatedTransformerXLLayer, both),
        (gtxl.GatedTransformerXL, both),
        (memn2n.EndToEndMemoryNetwork, {"d": "embed_dim"}),
        (memn2n.position_encoding, {"d": "embed_dim"}),
        (ak.memory.MemoryNetwork, {"embedding_dim": "embed_dim"}),
        (dsa.LightningIndexer, {"heads": "num_heads"}),
        *((cls, heads) for cls in per_head),
        *((cls, {"n_heads": "num_heads"}) for cls in spans),
        (ak.patterns.block_mask, heads),
        (ak.kernels.BlockMask.from_mask_mod, heads),
        (layers.HeadwiseLinear, heads),
        (ak.positions.Sinusoidal, width),
        (ak.positions.Learned, width),
        (ak.positions.sinusoid_table, width),
        (long_range.EncoderClassifier, both),
        (digits_task.DigitsViT, {"d": "embed_dim", "heads": "num_heads"}),
        (digits_task.DigitsModel, {"d": "embed_dim"}),
        (mqar_task.MQARDecoder, width),
        (mqar_task.build_attention_layer, width),
    ]


@pytest.mark.parametrize(
    ("target", "table"), _renamed_public_callables(), ids=lambda x: getattr(x, "__name__", "")
)
def test_public_sizes_use_the_one_spelling(target, table) -> None:
    """DESIGN 8: the new name is the parameter; the old keyword is refused, naming it."""
    params = inspect.signature(target).parameters
    for old, new in table.items():
        assert new in params and old not in params
        with pytest.raises(TypeError, match=rf"`{old}` is now `{new}`"):
            target(**{old: 4})


def _deprecated_per_head_parts():
    """The per-head parts whose per-head size was ``d=``: (class, other arguments, inputs)."""
    import torch

    from attnkit import efficient as ef
    from attnkit.efficient import synthesizer as sy

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    return [
        (ef.Performer, {"n_features": 8}, (q, k, v)),
        (ef.LSHAttention, {"n_buckets": 2, "chunk_size": 3}, (q, k, v)),
        (ef.RoutingAttention, {"n_clusters": 2}, (q, k, v)),
        (ef.SinkhornAttention, {"block_size": 2}, (q, k, v)),
        (ef.RandomFeatureAttention, {"n_features": 8}, (q, k, v)),
        (sy.DenseSynthetic, {"max_len": 6, "num_heads": 2}, (q, k)),
        (sy.FactorizedDenseSynthetic, {"a": 2, "b": 3, "num_heads": 2}, (q, k)),
    ]


@pytest.mark.parametrize(
    ("cls", "rest", "inputs"),
    _deprecated_per_head_parts(),
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_per_head_size_is_head_dim_and_d_still_works_for_a_release(cls, rest, inputs) -> None:
    """DESIGN 8: ``head_dim`` is the one name of the per-head size; ``d=`` warns, naming it."""
    import torch

    params = inspect.signature(cls).parameters
    assert "head_dim" in params and "d" not in params
    torch.manual_seed(1)  # the parts that draw their weights from the global generator
    new = cls(head_dim=4, **rest).eval()
    torch.manual_seed(1)
    with pytest.warns(DeprecationWarning, match=r"d= is renamed head_dim=; d= will be removed"):
        old = cls(d=4, **rest).eval()
    assert old.head_dim == new.head_dim == 4
    assert type(old) is type(new) and old.extra_repr() == new.extra_repr()
    old_state, new_state = old.state_dict(), new.state_dict()
    assert old_state.keys() == new_state.keys()
    for key, value in new_state.items():
        assert torch.equal(old_state[key], value), key
    torch.testing.assert_close(_context(old(*inputs)), _context(new(*inputs)), rtol=0, atol=0)
    with pytest.raises(TypeError, match=rf"^{cls.__name__}: got both `d` and `head_dim`"):
        cls(d=4, head_dim=4, **rest)
    with pytest.raises(TypeError, match=rf"^{cls.__name__}: got both `d` and `head_dim`"):
        cls(4, d=4, **rest)


def _context(out):
    return getattr(out, "context", out)


@pytest.mark.parametrize("name", ["performer", "lsh", "routing", "sinkhorn", "rfa"])
def test_registry_and_for_heads_take_head_dim(name) -> None:
    from attnkit import mechanisms

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mechanisms.build(name, head_dim=4).head_dim == 4
        built = mechanisms.REGISTRY.get(name).for_heads(
            embed_dim=8, num_heads=2, head_dim=4, max_len=8
        )
        assert built.head_dim == 4
    with pytest.warns(DeprecationWarning, match="head_dim"):
        assert mechanisms.build(name, d=4).head_dim == 4
    with pytest.raises(TypeError, match=rf"mechanism '{name}': got both `d` and `head_dim`"):
        mechanisms.build(name, d=4, head_dim=4)
