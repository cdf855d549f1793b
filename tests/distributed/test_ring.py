"""Ring attention equals the single-process kernels on the whole sequence (float64, 1e-10),
forward and gradients, for scores × streaming alignments, causal or not, with key padding, both
layouts, block masks and score_mod; bad calls are refused on every rank; a rank that stops makes
the others raise.

One world of 4 processes is started once (gloo over a FileStore in tmp_path); it runs the rings
of 2, 3 and 4 ranks (subgroups) with every case inside the workers (ring_workers.py), which
report what failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import attnkit as ak
from attnkit.distributed import reasons_not_supported, ring_attention

sys.path.insert(0, str(Path(__file__).parent))  # spawned workers import ring_workers by name
import ring_workers

WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One spawned world of 4 processes runs the rings of 2, 3 and 4 ranks."""
    out = tmp_path_factory.mktemp("ring")
    # fork starts the workers in a fraction of a second (spawn re-imports torch in each), and
    # nothing distributed or CUDA runs in this process before; spawn where fork is missing.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        ring_workers.run, args=(WORLD, str(out)), nprocs=WORLD, join=True, start_method=method
    )
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_equals_single_process(world, results):
    reports = [
        json.loads((results / f"world{world}_rank{r}.json").read_text()) for r in range(world)
    ]
    failures = [f for r in reports for f in r["failures"]]
    assert not failures, "\n".join(failures)
    cases, _, extras = ring_workers._plan(world)
    # every case, the block mask / score_mod cases, the refused calls
    expected = len(cases) + (0 if not extras else 16 if world == 2 else 6) + 6
    assert [r["checks"] for r in reports] == [expected] * world


def test_a_rank_that_stops_makes_the_others_raise(results):
    report = json.loads((results / "dies.json").read_text())
    assert not report["failures"], "\n".join(report["failures"])
    assert report["dies"] == 1  # rank 0 raised RingError naming the cause


def test_unsupported_parts_are_named():
    additive_multi = ak.scores.Additive(4, 4, 5, d_out=3)
    reasons = reasons_not_supported(additive_multi, ak.alignments.Softmax())
    assert any("single-dimensional" in r for r in reasons)
    reasons = reasons_not_supported(ak.scores.ScaledDot(), ak.alignments.Entmax(3.0))
    assert any("α" in r for r in reasons)
    assert reasons_not_supported(ak.scores.ScaledDot(), ak.alignments.Sparsemax()) == []


def test_refused_without_a_process_group():
    x = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="init_process_group"):
        ring_attention(x, x, x)
    with pytest.raises(ValueError, match="cannot evaluate"):
        ring_attention(x, x, x, align="hard")


@pytest.mark.cuda
def test_nccl_ring_equals_single_process(tmp_path):
    world = torch.cuda.device_count()
    if world < 2:
        pytest.fail(f"needs at least 2 CUDA devices, found {world}")
    mp.spawn(ring_workers.run_nccl, args=(2, str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    failures = [f for r in reports for f in r["failures"]]
    assert not failures, "\n".join(failures)
    assert all(r["checks"] == len(ring_workers._plan(3)[0]) for r in reports)
