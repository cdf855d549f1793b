"""Headless Chromium for the tests that open a page: where it is, a skip mark for machines
without it, and the DOM of a page after its scripts ran."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["chromium", "dump_dom", "needs_chromium"]


def chromium() -> str | None:
    """The Chromium binary, or None where it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


needs_chromium = pytest.mark.skipif(
    chromium() is None, reason="chromium not installed (apt-get install chromium)"
)


def dump_dom(page: Path, profile: Path, *flags: str, timeout: float = 120) -> str:
    """The DOM of the file ``page`` after its scripts ran, as headless Chromium dumps it, with a
    fresh profile in ``profile`` and any further ``flags``; fails the test when Chromium
    fails."""
    result = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            *flags,
            f"--user-data-dir={profile}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
