"""attnkit.benchmarking.gpu and benchmarks/gpu/run.sh without an accelerator: kernel selection
for calls on a CUDA device (tensors that report a CUDA device), the pieces of the report, and
the script's dry run on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit import patterns
from attnkit.benchmarking import gpu
from attnkit.kernels.base import get

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "run.sh"


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: what kernel selection reads of a CUDA call
    (its values stay on the CPU, so nothing is evaluated on it)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    @property
    def is_cuda(self) -> bool:
        return True


def _qkv(n: int = 256, on_cuda: bool = True, grad: bool = False):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        x = torch.randn(1, 2, n, 64, generator=g).requires_grad_(grad)
        out.append(x.as_subclass(_OnCuda) if on_cuda else x)
    return out


WINDOW = patterns.block_mask(patterns.sliding_window(32), 256)


def _alibi(e, b, h, q_idx, kv_idx):
    return e + 0.5 * (kv_idx - q_idx)


def _chosen(e: ak.kernels.Explanation) -> ak.kernels.Verdict:
    return next(v for v in e.verdicts if v.kernel == e.chosen)


def test_the_stand_in_reports_cuda_to_the_call():
    q, _, _ = _qkv()
    assert q.device.type == "cuda" and q[..., :0, :].device.type == "cuda"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_mask": WINDOW},
        {"block_mask": WINDOW, "score_mod": _alibi},
        {"block_mask": WINDOW, "grad": True},
    ],
    ids=["window", "window+alibi", "window, training"],
)
def test_block_sparse_on_cuda_skips_the_cpu_only_fused_path_and_says_why(kwargs):
    kwargs = dict(kwargs)
    grad = kwargs.pop("grad", False)
    e = ak.kernels.explain(*_qkv(grad=grad), **kwargs)
    verdict = _chosen(e)
    assert e.chosen == "chunked" and verdict.path == "tiled"
    skipped = dict(verdict.skipped_paths)
    assert "fused" in skipped
    assert any("cpu" in why and "cuda" in why for why in skipped["fused"]), skipped
    assert "runs on cpu, not on cuda" in str(e)


def test_the_same_block_sparse_call_on_the_cpu_takes_the_fused_path():
    # the control: the CUDA verdict above comes from the device, not from the call's shape
    e = ak.kernels.explain(*_qkv(on_cuda=False), block_mask=WINDOW)
    assert e.chosen == "chunked" and _chosen(e).path == "fused"


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"block_mask": WINDOW},
        {"block_mask": WINDOW, "score_mod": _alibi},
        {"align": "sparsemax"},
        {"align": "entmax15", "chunk_size": 64},
        {"score": "dot"},
        {"mask": torch.ones(256, 256, dtype=torch.bool).tril().as_subclass(_OnCuda)},
    ],
    ids=["plain", "window", "alibi", "sparsemax", "entmax15", "dot", "dense mask"],
)
def test_no_cuda_call_selects_a_kernel_or_path_that_runs_only_elsewhere(kwargs):
    e = ak.kernels.explain(*_qkv(), **kwargs)
    verdict = _chosen(e)
    kernel = get(e.chosen)
    devices = [kernel.supports_devices]
    if verdict.path is not None:
        devices.append(kernel.path(verdict.path).supports_devices)
    assert all(d is None or "cuda" in d for d in devices), (e.chosen, verdict.path, devices)


def test_selection_names_kernel_path_and_the_skipped_path():
    text = gpu.selection(*_qkv(), block_mask=WINDOW)
    assert text.startswith("chunked (tiled); skipped fused:")
    assert "not on cuda" in text
    assert gpu.selection(*_qkv(on_cuda=False), block_mask=WINDOW) == "chunked (fused)"


def test_unknown_case_is_refused_naming_the_cases():
    with pytest.raises(ValueError, match="case: unknown 'nope'; expected one of sdpa, flex"):
        gpu.build("nope", "cpu", gpu.sizes_for("cpu", dry_run=True))


def test_a_case_whose_outputs_differ_is_not_timed():
    x = torch.ones(3)
    pair = gpu.Pair("a", "b", "-", lambda: x, lambda: x + 1, [], backward=False)
    with pytest.raises(AssertionError, match=r"outputs differ by 5\.0e-01"):
        gpu.measure(pair, "cpu", repeats=1, log=lambda m: None)


def test_measure_reports_the_paired_ratio_of_the_two_sides():
    x = torch.ones(4)
    calls = []

    def ours():
        calls.append("ours")
        return x * 1

    def theirs():
        calls.append("theirs")
        return x * 1

    r = gpu.measure(gpu.Pair("a", "b", "-", ours, theirs, [], backward=False), "cpu", 3, print)
    # check (2 calls), warm-up (2), then 3 pairs in alternating order
    assert calls[4:] == ["ours", "theirs", "theirs", "ours", "ours", "theirs"]
    assert r["diff"] == 0.0 and r["ratio"] > 0 and r["ours_mib"] is None


def test_table_names_device_versions_and_failed_cases():
    rows = [
        {"case": "sdpa", "label": "ak", "baseline": "F", "shape": "s", "pass": "fwd",
         "diff": 1e-7, "ours_ms": 1.0, "theirs_ms": 2.0, "ratio": 0.5, "ours_mib": 3.0,
         "theirs_mib": None, "kernel": "sdpa", "notes": ""},
        {"case": "flex", "error": "over the 90 s limit"},
    ]  # fmt: skip
    text = gpu.table(rows, "cpu", tests="3 passed in 1.0s", dry_run=True)
    assert f"torch {torch.__version__}; CUDA none" in text
    assert "| sdpa | ak | F | s | fwd | 1.0e-07 | 1.00 | 2.00 | **0.50** | 3.0 | - | sdpa |" in text
    assert "| flex | failed: over the 90 s limit |" in text
    assert "`pytest -m cuda`: 3 passed in 1.0s" in text


def test_a_case_past_its_timeout_is_reported_not_waited_for():
    r = gpu.run_in_subprocess("sdpa", "cpu", timeout=0.01, dry_run=True)
    assert r == {"case": "sdpa", "error": "over the 0.01 s limit"}


def _dry_run(tmp_path: Path, cases: str) -> tuple[subprocess.CompletedProcess, str]:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path),
        "ATTNKIT_GPU_CASES": cases,
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    report = tmp_path / "RESULTS-gpu.md"
    return done, report.read_text() if report.is_file() else ""


def test_run_sh_dry_run_writes_the_table(tmp_path):
    done, text = _dry_run(tmp_path, "sdpa,flex")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Dry run: CPU, tiny sizes" in text
    assert "| sdpa | ak.attention | F.scaled_dot_product_attention |" in text
    assert "| flex | ak.attention(block_mask=sliding_window) |" in text
    assert "failed" not in text


@pytest.mark.slow
def test_run_sh_dry_run_every_case(tmp_path):
    done, text = _dry_run(tmp_path, ",".join(gpu.CASES))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for name in gpu.CASES:
        assert f"| {name} | " in text
    assert "failed" not in text
