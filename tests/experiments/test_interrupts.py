"""Ctrl-C held until the step is complete."""

import os
import signal

import pytest

from attnkit.experiments.interrupts import StepGuard


def _ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_inside_a_step_waits_for_its_end():
    done = []
    with pytest.raises(KeyboardInterrupt), StepGuard() as guard:
        guard.in_step = True
        _ctrl_c()
        done.append("rest of the step")
        guard.step_done()
    assert done == ["rest of the step"]


def test_ctrl_c_outside_a_step_interrupts_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt), StepGuard():
        _ctrl_c()
        done.append("never")
    assert done == []


def test_a_second_ctrl_c_interrupts_at_once():
    with pytest.raises(KeyboardInterrupt), StepGuard() as guard:
        guard.in_step = True
        _ctrl_c()
        _ctrl_c()
        pytest.fail("the second Ctrl-C did not interrupt")


def test_the_previous_handler_is_restored():
    before = signal.getsignal(signal.SIGINT)
    with StepGuard():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
