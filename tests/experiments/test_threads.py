"""Thread choice: one thread for small work, more only for big steps, --threads wins."""

import pytest
import torch

from attnkit.experiments.threads import MIN_FLOPS_PER_THREAD, choose_threads, count_flops


@pytest.fixture(autouse=True)
def _no_thread_setting(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_small_work_gets_one_thread_and_says_why():
    n, why = choose_threads(None, 3e8, cores=8)
    assert n == 1 and "300 MFLOP" in why and why.startswith("auto")


def test_big_work_gets_more_threads_up_to_the_cores():
    assert choose_threads(None, 3 * MIN_FLOPS_PER_THREAD, cores=8)[0] == 3
    assert choose_threads(None, 100 * MIN_FLOPS_PER_THREAD, cores=2)[0] == 2


def test_requested_threads_win_and_are_checked():
    assert choose_threads(3, 1.0, cores=2) == (3, "chosen with --threads")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be a positive int"):
            choose_threads(bad, 1.0)


def test_count_flops_counts_a_matmul_and_leaves_the_random_state():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    before = torch.get_rng_state()
    assert count_flops(lambda: (a @ b, torch.rand(3))) == 2 * 8 * 16 * 4
    assert torch.equal(torch.get_rng_state(), before)


def test_omp_num_threads_is_a_choice_too(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(None, 1.0, cores=8) == (3, "from OMP_NUM_THREADS; --threads N overrides")
    assert choose_threads(2, 1.0, cores=8)[0] == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    assert choose_threads(None, 1.0, cores=8)[0] == 1
