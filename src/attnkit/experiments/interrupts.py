"""Ctrl-C during training, held until the current step is complete."""

from __future__ import annotations

import signal
import threading

__all__ = ["StepGuard"]


class StepGuard:
    """Inside ``with StepGuard() as guard:``, a Ctrl-C (SIGINT) that arrives while
    ``guard.in_step`` is True is held until ``guard.step_done()``, which then raises
    KeyboardInterrupt; outside a step, or at a second Ctrl-C, it interrupts at once. So a
    position saved after the interrupt is always between two complete steps.

    Signal handlers can only be set from the main thread; elsewhere the guard does nothing.
    """

    def __init__(self) -> None:
        self.in_step = False
        self.pending = False
        self._previous = None

    def __enter__(self) -> StepGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.in_step and not self.pending:
            self.pending = True
            return
        raise KeyboardInterrupt

    def step_done(self) -> None:
        self.in_step = False
        if self.pending:
            raise KeyboardInterrupt
