"""What every bench mode shares: a progress bar over its steps and a time limit per step.

A *step* is the unit a mode repeats and a user waits for: one train step, one checkpoint save, one
eval phase, one decode engine. ``StepProgress`` draws a tqdm bar on stderr (``--no-progress`` turns
it off) and runs each step under ``time_limit``: past ``--step-timeout-s`` seconds a
``StepTimeout`` is raised in the step (SIGALRM, main thread only), and should the step be stuck
inside one C call that never returns to Python (a hung kernel or collective), faulthandler dumps
every thread's stack and ends the process ``HARD_STOP_GRACE_S`` later.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

# After the soft limit, how long a step stuck in C may take before the process is ended.
HARD_STOP_GRACE_S = 60.0


@dataclass(frozen=True, kw_only=True)
class StepLimits:
    """The options every bench mode has (a mode's options dataclass inherits them)."""

    # Seconds one step (a train step, a save, an eval phase...) may take; 0 = no limit.
    step_timeout_s: float = 1200.0
    # A progress bar over the steps on stderr.
    progress: bool = True

    def __post_init__(self) -> None:
        if self.step_timeout_s < 0:
            raise ValueError(f"--step-timeout-s {self.step_timeout_s}: use seconds >= 0 (0 = no limit)")


class StepTimeout(TimeoutError):
    """A bench step ran past its ``--step-timeout-s``."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise ``StepTimeout`` in the body once it has run ``seconds`` (0 = no limit).

    Only the main thread receives signals; elsewhere the body runs without a limit.
    """
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame) -> None:
        raise StepTimeout(f"{what} ran past --step-timeout-s {seconds:g}")

    hard_stop = arm_hard_stop(seconds + HARD_STOP_GRACE_S)
    previous = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if hard_stop:
            faulthandler.cancel_dump_traceback_later()


def arm_hard_stop(seconds: float) -> bool:
    """End the process with every thread's stack after ``seconds`` (cancelled by the caller);
    False where the process has no real stderr file to write the stacks to."""
    stream = sys.__stderr__  # faulthandler needs a file descriptor; sys.stderr may be a capture
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=stream)
    except (AttributeError, TypeError, ValueError, OSError):  # None, or no fileno(): no backstop
        return False
    return True


class StepProgress:
    """A bar of ``total`` steps named ``name``; ``with progress.step("warm-up 1"):`` times one."""

    def __init__(self, name: str, total: int, limits: StepLimits) -> None:
        from tqdm import tqdm

        self.name, self.limits, self.done = name, limits, 0
        self.bar = tqdm(
            total=total, desc=f"bench {name}", unit="step", file=sys.stderr, disable=not limits.progress
        )

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Run one step under the time limit, then advance the bar (labelled with the step)."""
        self.bar.set_postfix_str(label, refresh=False)
        with time_limit(self.limits.step_timeout_s, f"bench {self.name}: {label}"):
            yield
        self.done += 1
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
