"""What of torchrun's output reaches the console, and the one line that reports a failure.

torchrun (`--tee 3`) prefixes each worker line with `[<role><local rank>]:`; its own lines (the
OMP_NUM_THREADS banner, worker restarts, the ~35-line ChildFailedError dump) have none. Every line
goes to the node log. The console gets the lines of the ranks it shows (the first and last global
rank by default), a text several ranks print at once only once (an error every rank raises), and
none of torchrun's own lines unless the launcher logs at debug level. When the job fails,
`summary()` is one line: the rank that failed first (torchrun's root-cause block), its exit code,
its last error line and the node log.

Two facts a preemption needs are read here too: whether torchrun reported a signal of its own
(`signalled`: then the launcher sends it none), and the trainer's `<reason>: saved at iteration N;
run the job again to resume` (`saved`), the only trace of the ranks' exit code 75 when torchrun
itself was signalled: it then exits 1 with a traceback and no root-cause block.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

_RANK_PREFIX = re.compile(r"^\[[A-Za-z_]+?(\d+)\]:")  # `[default3]:`; the dump's `[3]:` is torchrun's
_ROOT_CAUSE = "Root Cause (first observed failure)"
_ROOT_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_ERROR_LINE = re.compile(r"\b(\w*error|\w*exception|fatal)\b", re.IGNORECASE)
_AGENT_SIGNALLED = re.compile(r"Received \S+ death signal|Got termination signal")
_SAVED = re.compile(r"([^:\s][^:]*): saved at iteration (\d+); run the job again to resume")
RECENT_LINES = 200
"""How far back a console line counts as already shown by another rank."""
AGENT = -1
"""The key of torchrun's own lines among the per-rank records."""


@dataclass(kw_only=True)
class Failure:
    """torchrun's root cause: the first worker that failed."""

    rank: int | None = None
    local_rank: int | None = None
    exit_code: int | None = None


def exit_status(code: int) -> int:
    """A worker killed by signal N has exit code -N in torchrun's report; a shell would say 128 + N."""
    return 128 - code if code < 0 else code


@dataclass(frozen=True)
class Saved:
    """The trainer's report of a stop on request (preemption, time limit) after its checkpoint."""

    reason: str
    """`preempted (SIGTERM)`, `exit_duration_in_mins reached`."""
    iteration: int


class TorchrunOutput:
    """Routes each line (node log always, console sometimes) and remembers what a failure report needs."""

    def __init__(self, show: set[int] | None, *, show_agent: bool) -> None:
        self.show = show
        """Local ranks whose lines reach the console; None for all."""
        self.show_agent = show_agent
        self.failure: Failure | None = None
        self.signalled = False
        """torchrun logged that a signal reached it (it forwards it to the ranks by itself)."""
        self.saved: Saved | None = None
        self._in_root_cause = False
        self._last_line: dict[int, str] = {}
        self._last_error: dict[int, str] = {}
        self._recent: deque[tuple[str, int]] = deque(maxlen=RECENT_LINES)

    def to_console(self, line: str) -> bool:
        """Record one line of torchrun's output; True when it belongs on the console."""
        m = _RANK_PREFIX.match(line)
        rank = int(m.group(1)) if m else AGENT
        text = line[m.end() :] if m else line
        self._remember(rank, text.strip())
        if m is None:
            self._parse_root_cause(line)
            self.signalled = self.signalled or bool(_AGENT_SIGNALLED.search(line))
            return self.show_agent
        if saved := _SAVED.search(text):
            self.saved = Saved(reason=saved.group(1), iteration=int(saved.group(2)))
        if self.show is not None and rank not in self.show:
            return False
        if any(seen == text and other != rank for seen, other in self._recent):
            return False
        self._recent.append((text, rank))
        return True

    def _remember(self, rank: int, text: str) -> None:
        if not text:
            return
        self._last_line[rank] = text
        if _ERROR_LINE.search(text) and not text.startswith(("Traceback", 'File "')):
            self._last_error[rank] = text

    def _parse_root_cause(self, line: str) -> None:
        if self.failure is None and _ROOT_CAUSE in line:
            self.failure = Failure()
            self._in_root_cause = True
        elif self._in_root_cause and self.failure is not None:
            if m := _ROOT_RANK.search(line):
                self.failure.rank, self.failure.local_rank = int(m.group(1)), int(m.group(2))
            elif m := _EXITCODE.search(line):
                self.failure.exit_code = int(m.group(1))
                self._in_root_cause = False

    def worker_exit_code(self) -> int | None:
        """The exit code of the worker that failed first (torchrun itself exits 1 whatever it was)."""
        if self.failure is None or self.failure.exit_code is None:
            return None
        return exit_status(self.failure.exit_code)

    def last_error(self, rank: int) -> str:
        return self._last_error.get(rank) or self._last_line.get(rank) or "(no output)"

    def summary(self, rc: int, log: str) -> str:
        """One line: who failed first, with what, and where the whole output is."""
        f = self.failure
        if f is not None and f.local_rank is not None and f.exit_code is not None:
            who = f"rank {f.rank} failed first with exit code {exit_status(f.exit_code)}"
            return f"{who}: {self.last_error(f.local_rank)} (full output: {log})"
        return f"torchrun exited with code {rc}: {self.last_error(AGENT)} (full output: {log})"
