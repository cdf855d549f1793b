"""A score, a per-head attention part, a task, a kernel and a position scheme of one's own are
each one file plus its test (docs/extending.md, "One file plus its test"): the ten files that
section shows are written, as they are printed there, into an empty directory; the five modules
are imported and the five tests run, and each part is then used where attnkit takes one, with no
other edit: the score by name in ``MultiHeadAttention(score=...)`` and through the chunked
kernel; the head part in ``MultiHeadAttention(attention=...)``, a ``TransformerEncoderLayer``, a
``DecoderLM`` decoding with a KV cache and every check of the per-head contract
(``tests/test_head_contract.py``), which a deliberately broken copy of the part (its mask not
applied) fails; the task through a tiny ``attnkit run --task-module``; the kernel by name in
``MultiHeadAttention(kernel=...)`` (and never by automatic selection); the position scheme by
name in ``MultiHeadAttention(position=...)``, whole and decoding with a KV cache.

The references are computed here from the equations (torch.cdist for the L1 distances, the
per-head projections written out, the distance penalty from its positions), not by the parts
under test. tests/test_extending_in_tree.py places the same five modules inside a copy of
attnkit and runs the registry-wide suites over them.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.registry import Registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
MODULES = {
    "manhattan.py",
    "sigmoid_part.py",
    "marker_task.py",
    "dense64_kernel.py",
    "nearby_position.py",
}
TESTS = {f"test_{module}" for module in MODULES}
# a fenced block whose first line names the file it is: "# name.py"
FILE_BLOCK = re.compile(r"^```(python3?)\n# (\w+\.py)\n(.*?)^```", re.S | re.M)
E, H = 8, 2
F64 = torch.float64


def files_in_the_docs() -> dict[str, tuple[str, str]]:
    """{file name: (the block's language, the file's text)} for every block naming a file."""
    found = FILE_BLOCK.findall(DOC.read_text(encoding="utf-8"))
    return {name: (lang, f"# {name}\n{body}") for lang, name, body in found}


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty directory holding the ten files, first on the import path; afterwards the
    registries, the imported user modules and the loaded task files are as they were."""
    from attnkit.tasks import user

    # Fill the lazily loaded registries first: a snapshot taken before a package registers its
    # parts would drop them on restore, while the package stays imported and never re-registers.
    for registry in (
        ak.mechanisms,
        ak.head_registry,
        ak.scores,
        ak.alignments,
        ak.positions,
        ak.tasks,
    ):
        registry.available()
    tables = [(r, r.snapshot()) for r in list(Registry.instances)]
    monkeypatch.setattr(user, "_modules", {})
    for name, (_, text) in files_in_the_docs().items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in list(sys.modules):
        if name in {Path(f).stem for f in MODULES | TESTS} or name.startswith(
            "attnkit_user_task_marker_task"
        ):
            del sys.modules[name]
    for registry, table in tables:
        registry.restore(table)


def _run_user_tests(module_name: str, *args) -> None:
    tests = importlib.import_module(module_name)
    functions = [f for n, f in vars(tests).items() if n.startswith("test_") and callable(f)]
    assert functions, f"{module_name} defines no test"
    for function in functions:
        function(*args)


def test_each_extension_is_one_module_and_its_test():
    files = files_in_the_docs()
    assert set(files) == MODULES | TESTS
    # the modules run as they are in the documentation test; the tests import their module,
    # so that test leaves them (python3) to this file
    assert {n for n, (lang, _) in files.items() if lang == "python"} == MODULES
    assert {n for n, (lang, _) in files.items() if lang == "python3"} == TESTS
    for module in MODULES:
        assert f"test_{module}" in files


def _heads(x, weight, bias):
    """(B, L, E) → (B, H, L, d) by one projection."""
    return (x @ weight.T + bias).unflatten(-1, (H, E // H)).transpose(1, 2)


def _multi_head(mha, x, weights_of):
    """Multi-head self-attention written out: per-head projections (the packed in_proj of
    q, k, v), weights from ``weights_of(q, k)``, the heads concatenated and W^O."""
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3)
    q, k, v = _heads(x, w_q, b_q), _heads(x, w_k, b_k), _heads(x, w_v, b_v)
    context = (weights_of(q, k) @ v).transpose(1, 2).flatten(-2)
    return mha.out_proj(context)


def test_a_score_in_one_file_works_by_name_and_in_the_chunked_kernel(user_dir):
    importlib.import_module("manhattan")
    assert "manhattan" in ak.scores.available()
    _run_user_tests("test_manhattan")

    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score="manhattan", dtype=F64).eval()
    x = torch.randn(2, 5, E, dtype=F64)
    want = _multi_head(mha, x, lambda q, k: torch.softmax(-torch.cdist(q, k, p=1), -1))
    torch.testing.assert_close(mha(x).context, want)

    q, k, v = (torch.randn(2, n, 4, dtype=F64) for n in (3, 11, 11))
    ref = torch.softmax(-torch.cdist(q, k, p=1), -1) @ v
    chunked = ak.attention(q, k, v, score="manhattan", kernel="chunked", chunk_size=4)
    torch.testing.assert_close(chunked.context, ref)


def _contract_checks(part_class) -> list:
    """The checks of tests/test_head_contract.py that apply to ``part_class``: those run over
    every part, and those run over the parts declaring what it declares."""
    import test_head_contract as contract

    checks = []
    for name, check in vars(contract).items():
        marks = getattr(check, "pytestmark", [])
        params = [m.args[1] for m in marks if m.name == "parametrize" and m.args[0] == "name"]
        if not name.startswith("test_") or not params:
            continue
        if params[0] is contract.PARTS:  # over every part
            checks.append(check)
    if part_class.normalized_weights:
        checks.append(contract.test_weights_declared_normalized_sum_to_one)
    if not part_class.any_value_size:
        checks.append(contract.test_a_part_for_values_of_head_dim_refuses_other_values_naming_them)
    assert len(checks) >= 10, [c.__name__ for c in checks]
    return checks


def test_a_head_part_in_one_file_works_in_the_layers_the_cache_and_the_contract(user_dir):
    from attnkit.models.decoder_lm import DecoderLM

    sigmoid_part = importlib.import_module("sigmoid_part")
    _run_user_tests("test_sigmoid_part")
    part_class = sigmoid_part.SigmoidAttention
    assert ak.head_registry.REGISTRY.get("sigmoid_attention") is part_class
    assert "sigmoid_attention" in ak.head_registry.available()
    assert ak.mechanisms.REGISTRY.get("sigmoid_attention") is part_class  # delegated

    # every check of the per-head contract, as tests/test_head_contract.py runs them over
    # attnkit's own parts
    for check in _contract_checks(part_class):
        check("sigmoid_attention")

    # in multi-head attention: σ(q·k/√d − log max_len) per head, a padded key weighted 0
    torch.manual_seed(1)
    part = part_class.for_heads(embed_dim=E, num_heads=H, head_dim=E // H, max_len=8)
    assert part.max_len == 8  # filled from the sizes
    mha = ak.MultiHeadAttention(E, H, attention=part, dtype=F64).eval()
    x = torch.randn(2, 5, E, dtype=F64)
    keep = ak.masks.from_lengths(torch.tensor([5, 3]), 5)  # (2, 1, 5)

    def sigmoid_weights(q, k):
        w = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(E // H) - math.log(8))
        return w * keep[:, None]

    torch.testing.assert_close(mha(x, mask=keep).context, _multi_head(mha, x, sigmoid_weights))

    # in an encoder layer: padding reaches no real token
    layer = ak.TransformerEncoderLayer(E, H, 16, attention=part_class(max_len=8)).double().eval()
    other = x.clone()
    other[1, 3:] = 100.0
    with torch.no_grad(), ak.evaluation.capture(layer) as records:
        out = layer(x, mask=keep)
    torch.testing.assert_close(layer(other, mask=keep)[1, :3], out[1, :3])
    (weights,) = records.values()
    assert weights[0].shape == (2, H, 5, 5)

    # in a decoder LM: decoding step by step with a KV cache equals the whole sequence
    lm = DecoderLM(11, E, H, 1, max_len=8, attention=part_class(max_len=8)).double().eval()
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = lm(tokens)
        cache = lm.new_cache()
        steps = [lm(tokens[:, :3], cache=cache)]
        steps += [lm(tokens[:, t : t + 1], cache=cache) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), whole)


def broken_part(text: str) -> str:
    """sigmoid_part.py with its mask not applied: a masked key keeps its weight σ(e)."""
    applied = "            w = w.masked_fill(~mask, 0.0)\n"
    assert text.count(applied) == 1
    return text.replace(applied, "            pass  # the mask is not applied\n")


def test_a_broken_head_part_fails_the_contract(user_dir):
    """The part with its mask not applied: the template already hides keys no query may
    attend, but a causal mask's later keys reach earlier queries, which the contract sees."""
    import test_head_contract as contract

    (user_dir / "sigmoid_part.py").write_text(
        broken_part(files_in_the_docs()["sigmoid_part.py"][1])
    )
    part_class = importlib.import_module("sigmoid_part").SigmoidAttention
    failed = []
    for check in _contract_checks(part_class):
        try:
            check("sigmoid_attention")
        except AssertionError:
            failed.append(check.__name__)
    assert contract.test_declared_mask_forms_are_honoured_and_others_refused.__name__ in failed


def test_a_task_in_one_file_runs_with_attnkit_run(user_dir, monkeypatch):
    from attnkit.experiments import runner

    # the HTML report's figures take seconds and read nothing of the task's contract
    monkeypatch.setattr(runner, "write_report", lambda run_dir, *_, **__: run_dir / "report.html")
    runs = user_dir / "runs"
    _run_user_tests("test_marker_task", runs)  # attnkit run --task-module marker_task.py:Marker
    config = json.loads((runs / "marker" / "config.json").read_text())
    assert config["task"] == "marker"
    assert config["task_module"] == "marker_task:Marker=marker"  # imported again on --resume
    assert ak.tasks.get("marker") is sys.modules["marker_task"].Marker


def test_a_kernel_in_one_file_is_taken_by_name_and_only_by_name(user_dir):
    importlib.import_module("dense64_kernel")
    _run_user_tests("test_dense64_kernel")
    assert "dense64" in ak.kernels.available()

    # in multi-head attention, named: per-head softmax(q·k/√d) over the unpadded keys
    torch.manual_seed(3)
    mha = ak.MultiHeadAttention(E, H, kernel="dense64").eval()
    x = torch.randn(2, 5, E)
    keep = ak.masks.from_lengths(torch.tensor([5, 2]), 5)

    def softmax_weights(q, k):
        e = q.double() @ k.double().transpose(-1, -2) / math.sqrt(E // H)
        return torch.softmax(e.masked_fill(~keep[:, None], -math.inf), -1).float()

    torch.testing.assert_close(mha(x, mask=keep).context, _multi_head(mha, x, softmax_weights))
    # left to choose, attnkit never takes it; what it does not declare is refused by name
    q = torch.randn(1, 2, 4, 8)
    assert ak.kernels.explain(q, q, q, need_weights=True).chosen == "dense"
    with pytest.raises(ValueError, match=r"kernel 'dense64' .* takes no block mask"):
        ak.attention(
            q,
            q,
            kernel="dense64",
            block_mask=ak.patterns.block_mask(
                ak.patterns.sliding_window(2), 4, 4, block_q=2, block_k=2
            ),
        )


def test_a_position_scheme_in_one_file_is_built_by_name_in_multi_head_attention(user_dir):
    importlib.import_module("nearby_position")
    _run_user_tests("test_nearby_position")
    assert "nearby" in ak.positions.available()

    torch.manual_seed(4)
    mha = ak.MultiHeadAttention(E, H, position="nearby", dtype=F64).eval()
    x = torch.randn(2, 5, E, dtype=F64)
    i = torch.arange(5, dtype=F64)
    penalty = -(i[:, None] - i[None, :]).abs() / 4

    def biased_weights(q, k):
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(E // H) + penalty, -1)

    torch.testing.assert_close(mha(x).context, _multi_head(mha, x, biased_weights))
    # decoding with a KV cache places each new query after the cached keys
    cache = ak.kv_cache.LayerCache()
    causal = mha(x, mask=ak.masks.causal(5)).context
    steps = [mha(x[:, :2], mask=ak.masks.causal(2), cache=cache).context]
    steps += [mha(x[:, t : t + 1], cache=cache).context for t in range(2, 5)]
    torch.testing.assert_close(torch.cat(steps, 1), causal)
