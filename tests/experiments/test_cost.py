"""The cost of a run: wall time, and the peak memory added, measured afresh for each run."""

import torch

from attnkit.experiments import cost


def test_peak_is_what_the_block_added_and_is_reset_between_blocks():
    with cost.measure() as big:
        x = torch.ones(50 * 2**20 // 4)  # 50 MiB, touched
        del x
    with cost.measure() as small:
        y = torch.ones(2**20 // 4)  # 1 MiB
        del y
    assert big["train_seconds"] >= 0 and set(big) == {*cost.METRICS, "peak_is_lifetime"}
    assert 45 <= big["train_peak_mib"] <= 60
    if not small["peak_is_lifetime"]:  # Linux: the high-water mark was reset
        assert small["train_peak_mib"] < 20
