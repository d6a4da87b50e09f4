"""Fault handling around the training loop: stop requests, stall dumps, collective decisions.

- ``GracefulStop`` turns SIGTERM (and optionally SIGINT) into a flag. It never stops anything by
  itself: the trainer reads the flag at a step boundary and decides with ``any_rank_true``, so
  every rank saves and exits together (DESIGN.md section 5).
- ``Watchdog`` dumps every thread's stack when no step has started for ``timeout_s`` seconds, to
  find out where a hung collective or kernel is waiting. It only observes; it never kills.
- ``any_rank_true`` / ``any_rank_flags``: the one way a control-flow decision is made (stop, skip,
  save, non-finite loss), so no rank branches alone; ``any_rank_error`` / ``first_rank_error`` /
  ``raise_if_any_rank_failed``: the same for an error of work some ranks do alone (rank 0 writing a
  file, a rank's evaluation, a rank's read of the checkpoint to resume); ``failing_together`` wraps
  such work (a rank's start-up) in that vote.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist


class GracefulStop:
    """Context manager: SIGTERM (and SIGINT if ``handle_sigint``) set ``requested`` instead of killing.

    The previous handlers are restored on exit. A second SIGINT after a stop was requested raises
    ``KeyboardInterrupt`` as usual, so an impatient user can still interrupt at once. Must be
    entered from the main thread (Python only installs signal handlers there).
    """

    def __init__(self, *, handle_sigint: bool = False) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._signals = [signal.SIGTERM] + ([signal.SIGINT] if handle_sigint else [])
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "GracefulStop must be entered from the main thread (signal handlers live there)."
            )
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self._signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set flags here: printing from a signal handler can re-enter a print in progress.
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name


def report_deferred_stop(
    stop: GracefulStop, waited_for: str = "the final checkpoint and export were written first"
) -> None:
    """Say that a signal which arrived after the training loop waited for the final save and export."""
    if stop.requested:
        print(
            f"{stop.signal_name} received after the last step: {waited_for}; exiting",
            file=sys.stderr,
            flush=True,
        )


class Watchdog:
    """A daemon thread that dumps all thread stacks when ``beat`` has not been called for ``timeout_s``.

    Call ``beat(step)`` at the start of every step. A stall is reported once (to stderr and,
    appended, to ``dump_path``), then again only after a new beat and a new stall. ``timeout_s``
    <= 0 disables it. The thread only reads a timestamp and calls ``faulthandler``: it never
    touches torch or CUDA, so it cannot itself hang on the stuck device or process group.
    """

    def __init__(self, timeout_s: float, dump_path: str | Path | None = None) -> None:
        self.timeout_s = timeout_s
        self.dump_path = Path(dump_path) if dump_path is not None else None
        self.num_dumps = 0
        self._last_beat = time.monotonic()
        self._step: int | None = None
        self._beats = 0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="dflash-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int) -> None:
        """Mark the start of ``step`` (plain attribute writes: safe and cheap from the training thread)."""
        self._step = step
        self._last_beat = time.monotonic()
        self._beats += 1

    def _watch(self) -> None:
        poll_s = min(max(self.timeout_s / 10, 0.01), 10.0)
        reported_beat = -1
        while not self._closed.wait(poll_s):
            beats, stalled_s = self._beats, time.monotonic() - self._last_beat
            if stalled_s > self.timeout_s and beats != reported_beat:
                reported_beat = beats
                self._dump(stalled_s)

    def _dump(self, stalled_s: float) -> None:
        header = (
            f"\n=== dflash-train watchdog: no step started for {stalled_s:.0f}s "
            f"(last step {self._step}, timeout {self.timeout_s:g}s) at {time.strftime('%Y-%m-%d %H:%M:%S')}; "
            "stacks of all threads follow ===\n"
        )
        sys.stderr.write(header)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.dump_path is not None:
            self.dump_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.dump_path, "a") as f:
                f.write(header)
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        self.num_dumps += 1

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def any_rank_flags(flags: Sequence[bool], device: torch.device | str, group=None) -> list[bool]:
    """For each flag, whether it is set on any rank of ``group`` (None: all ranks): one all-reduce
    (MAX) for several decisions.

    Without an initialised process group the flags are returned as they are. ``device`` is where
    the collective runs (the rank's CUDA device for NCCL, CPU for gloo).
    """
    # Flags may be device tensors (e.g. a non-finite check): stack them without a host round trip each.
    votes = torch.stack([torch.as_tensor(f, device=device).reshape(()).to(torch.int32) for f in flags])
    if not (dist.is_available() and dist.is_initialized()):
        return [bool(v) for v in votes.tolist()]
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    # Host sync on purpose: the result decides which branch every rank takes.
    return [bool(v) for v in votes.tolist()]


def any_rank_error(error: BaseException | None, group=None) -> str | None:
    """Every rank of ``group`` (None: all ranks), after work that may have failed on some of them:
    the first failed rank's error as ``Type: message``, None when none failed (also a barrier).

    For work only some ranks do (rank 0 writing a file), or that each rank does alone: a rank that
    raised alone would leave the others waiting in their next collective; with this, every rank
    raises together.
    """
    found = first_rank_error(error, group)
    return None if found is None else found[1]


def first_rank_error(error: BaseException | None, group=None) -> tuple[int, str] | None:
    """``any_rank_error`` with the rank in ``group`` of the first failed rank: ``(rank, message)``."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    if not (dist.is_available() and dist.is_initialized()):
        return None if message is None else (0, message)
    found: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, message, group=group)
    return next(((rank, m) for rank, m in enumerate(found) if m is not None), None)


def raise_if_any_rank_failed(error: BaseException | None, group, describe: Callable[[int, str], str]) -> None:
    """Every rank of ``group``, after work each rank does alone (``error``: this rank's, None if it
    succeeded): if any rank failed, every rank raises the same ``RuntimeError(describe(rank, message))``
    of the first failed rank, so none waits in a later collective for a rank that raised alone."""
    found = first_rank_error(error, group)
    if found is not None:
        raise RuntimeError(describe(*found)) from error


@contextlib.contextmanager
def failing_together(group, describe: Callable[[int, str], str]) -> Iterator[None]:
    """Work each rank of ``group`` does alone before the ranks next meet (building its target,
    drafter or optimizer): its error goes into ``raise_if_any_rank_failed``, so every rank raises the
    same line at once instead of the others waiting for the failed rank in their next collective
    (until ``train.dist_timeout_s`` on NCCL). Alone (no process group, or a group of one) the error is
    raised as it is."""
    error = None
    try:
        yield
    except Exception as err:  # recovery boundary: the vote below raises it on every rank
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            raise
        error = err
    raise_if_any_rank_failed(error, group, describe)


def any_rank_true(flag: bool, device: torch.device | str) -> bool:
    """Whether ``flag`` is set on any rank (all-reduce MAX); the flag itself without a process group."""
    return any_rank_flags([flag], device)[0]
