"""attnkit.benchmarking.memory: the allocator settings for live-memory cells."""

from __future__ import annotations

import json
import subprocess
import sys

from attnkit.benchmarking.memory import LIVE_ALLOCATOR, live_env


def test_live_env_sets_glibc_variables_and_keeps_the_rest():
    env = live_env({"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "999"})
    assert env["PATH"] == "/bin"
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0"  # ours wins over an inherited value
    assert set(LIVE_ALLOCATOR) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}


def test_a_subprocess_started_with_live_env_sees_the_settings():
    code = (
        "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if 'MALLOC' in k}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=live_env(), capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == LIVE_ALLOCATOR


def test_live_peak_counts_what_the_call_held_at_its_peak():
    """A call that holds 64 MiB for a moment and returns 1 MiB: its peak counts the 64 MiB,
    where the reset is available (the result comes back either way); in a process whose
    allocator returns freed memory at once, as the memory cells run."""
    code = (
        "import json, torch\n"
        "from attnkit.benchmarking.memory import live_peak, reset_peak\n"
        "def call():\n"
        "    big = torch.ones(16 << 20)\n"
        "    return big[: 1 << 18].clone()\n"
        "out, added = live_peak(call)\n"
        "print(json.dumps({'n': out.numel(), 'added': added, 'reset': reset_peak()}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=live_env(), capture_output=True, text=True, check=True
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["n"] == 1 << 18
    if got["reset"]:
        assert 60 << 20 <= got["added"] < 100 << 20
    else:
        assert got["added"] is None
