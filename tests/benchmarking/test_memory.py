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
