"""The launcher's own signals: what the running child gets, and the exit code they leave.

* SIGINT goes to the child's process group as SIGINT. torchrun passes it to the ranks, which stop
  after the current step without saving; the launcher exits 130.
* SIGTERM and SIGUSR1 mean preemption. torchrun gets one SIGTERM, at its own pid; it forwards
  SIGTERM to the ranks, which save at the next iteration boundary and exit 75, and waits for them
  (its shutdown timeout, 30 s unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise). SIGUSR1
  never reaches torchrun: it has no handler for it and would die at once, before any rank saved.
  A signal Slurm sends to a job step reaches every process of the step, torchrun included, and
  more SIGTERMs while torchrun waits for its ranks can make it leave without them (from the third
  on); so inside a Slurm step the launcher first waits SETTLE_S for torchrun to report a signal of
  its own, and sends none if it did. Elsewhere nobody else signals torchrun (it runs in a session
  of its own): it gets SIGTERM at once.
* Any other child (a hook, srun, a container client, one plain process) gets SIGTERM for either.

The exit code: 75 when the child says the ranks saved and stopped (resumable, whatever asked for
it), else 128 + the signal the launcher received (130 for SIGINT), else the child's own code
(128 + N for a child killed by signal N). A child still running GRACE_S after the first signal is
killed with its process group.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress

from runner.errors import ConfigError

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL, the trainer's code for "saved on request; run the same command again to resume"."""
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SETTLE_S = 1.0
"""Inside a Slurm step: how long torchrun has to report a signal that reached it directly."""
TORCHRUN_SHUTDOWN_S = 30
"""torchrun's default wait for its ranks after it forwarded a signal (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""
MARGIN_S = 30.0
"""Beyond torchrun's shutdown timeout, before the launcher kills a child that did not stop."""


def prepare(env: Mapping[str, str]) -> None:
    """Set the grace period before any child starts: torchrun's shutdown timeout (the ranks save in
    it) plus MARGIN_S, so the launcher never cuts short a save that torchrun would let finish."""
    value = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(TORCHRUN_SHUTDOWN_S))
    if not value.isdigit():
        raise ConfigError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={value!r}: not a number of seconds. Set it to e.g. 60, or unset it."
        )
    _forwarder.grace_s = int(value) + MARGIN_S


class _Forwarder:
    """Passes the launcher's signals to the child that runs now (one child at a time)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.torchrun_noticed: Callable[[], bool] | None = None
        """For torchrun: whether it reported a signal of its own (then it needs none from us)."""
        self.settle_s = 0.0
        self.grace_s = TORCHRUN_SHUTDOWN_S + MARGIN_S
        self.received: int | None = None
        self.deadline: float | None = None
        self.preempt_at: float | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        self.received = self.received or signum
        self.deadline = self.deadline or time.monotonic() + self.grace_s
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            logger.warning("received SIGINT: forwarding it to %s", proc.args[0])
            killpg(proc, signal.SIGINT)
        elif self.torchrun_noticed is None:
            logger.warning("received %s: sending SIGTERM to %s", name, proc.args[0])
            killpg(proc, signal.SIGTERM)
        elif self.preempt_at is None:  # once: more SIGTERMs can cut torchrun's wait for the ranks short
            logger.warning("received %s: the ranks save at the next iteration boundary and stop", name)
            self.preempt_at = time.monotonic() + self.settle_s
            self.tick()

    def tick(self) -> None:
        """Called while waiting for the child: the delayed SIGTERM to torchrun, then the SIGKILL."""
        proc, now = self.proc, time.monotonic()
        if proc is None or proc.poll() is not None:
            return
        if self.preempt_at is not None and now >= self.preempt_at:
            self.preempt_at = float("inf")  # done: never again for this child
            if self.torchrun_noticed is not None and not self.torchrun_noticed():
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)  # torchrun alone: its ranks get it from torchrun
        if self.deadline is not None and now > self.deadline:
            logger.error(
                "%s did not stop within %.0f s of the signal: killing it", proc.args[0], self.grace_s
            )
            killpg(proc, signal.SIGKILL)
            self.deadline = None


def killpg(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's process group (it runs in a session of its own); gone already is fine."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


_forwarder = _Forwarder()


@contextmanager
def forwarding(
    proc: subprocess.Popen, *, torchrun_noticed: Callable[[], bool] | None = None, in_slurm_step: bool = False
) -> Iterator[None]:
    """Route the launcher's signals to `proc` while it runs; `torchrun_noticed` marks torchrun."""
    old = {s: signal.signal(s, _forwarder) for s in HANDLED}
    _forwarder.proc, _forwarder.torchrun_noticed = proc, torchrun_noticed
    _forwarder.settle_s = SETTLE_S if in_slurm_step else 0.0
    _forwarder.preempt_at = None
    if _forwarder.received:  # a signal arrived between two children: do not start the next one
        killpg(proc, signal.SIGTERM)
    try:
        yield
    finally:
        _forwarder.proc, _forwarder.torchrun_noticed = None, None
        for s, h in old.items():
            signal.signal(s, h)


def tick() -> None:
    _forwarder.tick()


def received() -> int | None:
    """The first signal the launcher received, or None."""
    return _forwarder.received


def exit_code(rc: int) -> int:
    """The launcher's exit code for a child that ended with status `rc` (see the module docstring)."""
    code = 128 - rc if rc < 0 else rc
    if code == PREEMPTED_EXIT_CODE:
        return code
    if _forwarder.received:  # ended on our signal: say so, whatever the child made of it
        return 128 + _forwarder.received
    return code
