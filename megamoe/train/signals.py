"""Stopping on request: preemption (SIGTERM, SIGUSR1 — Slurm's ``--signal=USR1@<s>``) saves and exits
resumable; SIGINT stops after the current step; ``exit_duration_in_mins`` and ``exit_interval`` stop
the same way as a preemption.

A handler only records the request. The loop asks at each iteration boundary, and the ranks agree
with one small all-reduce (a signal may reach them at slightly different moments), so every rank
saves the same iteration and leaves together.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL: the job stopped on request after saving; run it again to resume."""
INTERRUPTED_EXIT_CODE = 130


class Preempted(Exception):
    """Raised after the checkpoint of a preempted (or time-limited) run is saved."""

    def __init__(self, reason: str, iteration: int) -> None:
        super().__init__(f"{reason}: saved at iteration {iteration}; run the job again to resume")
        self.iteration = iteration


class Interrupted(Exception):
    """Raised at the iteration boundary after SIGINT; nothing is saved."""

    def __init__(self, iteration: int) -> None:
        super().__init__(
            f"interrupted (SIGINT) after iteration {iteration}; nothing saved since the last checkpoint"
        )


@dataclass(frozen=True)
class Verdict:
    save_and_exit: str | None
    """Why the run must save and stop now (a signal's name, a time limit), or None."""
    interrupt: bool


class StopRequests:
    """Records SIGTERM/SIGUSR1/SIGINT while installed; :meth:`agree` turns them into one verdict."""

    _PREEMPT = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, *, handle_signals: bool, exit_duration_in_mins: float | None) -> None:
        self._preempted_by: str | None = None
        self._interrupted = False
        self._deadline = time.monotonic() + exit_duration_in_mins * 60 if exit_duration_in_mins else None
        self._previous: dict[int, object] = {}
        if handle_signals:
            for sig in self._PREEMPT:
                self._previous[sig] = signal.signal(sig, self._on_preempt)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_preempt(self, signum: int, frame: FrameType | None) -> None:
        self._preempted_by = signal.Signals(signum).name

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self._interrupted:  # a second Ctrl-C: leave now
            raise KeyboardInterrupt
        self._interrupted = True

    def agree(self) -> Verdict:
        """Every rank's requests, combined (a collective: every rank calls it at the same boundary)."""
        timed_out = self._deadline is not None and time.monotonic() >= self._deadline
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        flags = torch.tensor(
            [self._preempted_by is not None, timed_out, self._interrupted], dtype=torch.int32, device=device
        )
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        preempt, late, interrupt = (bool(v) for v in flags.tolist())
        reason = None
        if preempt:
            reason = f"preempted ({self._preempted_by or 'a signal on another rank'})"
        elif late:
            reason = "exit_duration_in_mins reached"
        return Verdict(save_and_exit=reason, interrupt=interrupt)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
