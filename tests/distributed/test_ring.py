"""Ring attention equals the single-process kernels on the whole sequence (float64, 1e-10),
forward and gradients, for scores × streaming alignments, causal or not, with key padding, both
layouts, block masks and score_mod; bad calls are refused on every rank; a rank that stops makes
the others raise.

Each world size is spawned once (gloo over a FileStore in tmp_path) and runs every case inside
its workers (ring_workers.py), which report what failed.
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


def _spawn(world: int, tmp_path: Path) -> list[dict]:
    mp.spawn(ring_workers.run, args=(world, str(tmp_path)), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_equals_single_process(world, tmp_path):
    results = _spawn(world, tmp_path)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures)
    cases, _, extras = ring_workers._plan(world)
    # every case, the block mask / score_mod cases, the refused calls
    expected = len(cases) + (0 if not extras else 6 if world == 2 else 3) + 5
    assert [r["checks"] for r in results] == [expected] * world
    if world == 2:
        assert results[0]["dies"] == 1  # rank 0 raised RingError when rank 1 stopped


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
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.fail("needs at least 2 CUDA devices")
    results = _spawn_nccl(2, tmp_path)
    assert all(not r["failures"] for r in results), results


def _spawn_nccl(world: int, tmp_path: Path) -> list[dict]:
    mp.spawn(ring_workers.run_nccl, args=(world, str(tmp_path)), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
