"""Shared by the rebuild hook's modules: errors, secret redaction, progress, child processes.

Children run in their own process group, so a signal to the hook (Ctrl-C, the launcher's hook
timeout) stops the whole compile, and `finally` blocks still remove partial dirs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import NoReturn

LOG_TAIL_LINES = 40
_USERINFO_RE = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


class HookError(Exception):
    """A failure the user can act on; `code` is the hook's exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def setting_error(name: str, value: str, problem: str, remedy: str) -> HookError:
    """Bad input: ``<SETTING>=<value>: <problem>. <remedy>.`` with exit status 2."""
    return HookError(f"{name}={redact(value)}: {problem}. {remedy.rstrip('.')}.", code=2)


def redact(text: str) -> str:
    """Hide the userinfo of every URL (``https://user:token@host`` -> ``https://***@host``)."""
    return _USERINFO_RE.sub(r"\1***@", text)


def say(message: str) -> None:
    """Progress line on stderr (the launcher shows it; stdout is the hook protocol)."""
    print(f"[primus-turbo] {redact(message)}", file=sys.stderr, flush=True)


_children: set[subprocess.Popen] = set()


def on_signal(signum: int, _frame: object) -> NoReturn:
    """Stop the build's process group, then unwind so `finally` blocks remove partial dirs."""
    for child in list(_children):
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGTERM)
    raise HookError(f"interrupted by signal {signum}; the previous install is untouched", 128 + signum)


def run(
    argv: list,
    *,
    cwd: str | None = None,
    env: dict | None = None,
    log=None,
    heartbeat: str = "",
    every_s: float = 30.0,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run argv in its own process group, stdout+stderr redacted into `log` (or captured).

    With `heartbeat`, prints "<heartbeat> <elapsed>: <last log line>" every `every_s` seconds so a
    ten-minute compile shows it is alive.
    """
    child = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
        errors="replace",
    )
    _children.add(child)
    tail: deque = deque(maxlen=LOG_TAIL_LINES)
    captured: list = []
    last = [""]

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            line = redact(line)
            tail.append(line)
            if line.strip():
                last[0] = line.strip()
            if log is not None:
                log.write(line)
                log.flush()
            else:
                captured.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        while True:
            try:
                child.wait(timeout=every_s if heartbeat else None)
                break
            except subprocess.TimeoutExpired:
                say(f"{heartbeat} {time.monotonic() - start:.0f}s: {last[0][:160]}")
        reader.join()
    finally:
        _children.discard(child)
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait()
    output = "".join(captured) if log is None else "".join(tail)
    result = subprocess.CompletedProcess(argv, child.returncode, output, "")
    if check and child.returncode != 0:
        raise subprocess.CalledProcessError(child.returncode, argv, output)
    return result


def git(*args: str, cwd: str | None = None, log=None, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="/bin/true")
    return run(["git", *args], cwd=cwd, env=env, log=log, check=check)


def git_out(*args: str, cwd: str) -> str | None:
    """Output of a read-only git query, or None when it fails (unknown ref, not a repo)."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def step_name(argv: list) -> str:
    """`pip wheel`, `git fetch`, `import check`: which step failed, in words."""
    args = [str(a) for a in argv]
    if args[1:3] == ["-m", "pip"]:
        return "pip " + next((a for a in args[3:] if not a.startswith("-")), "")
    if os.path.basename(args[0]) == "git":
        return "git " + args[1]
    return "the import check of the new build" if "-c" in args else os.path.basename(args[0])


def failure_report(e: subprocess.CalledProcessError, log_path: str) -> str:
    tail = (e.output or "").rstrip()
    return (
        f"{step_name(e.cmd)} failed with exit code {e.returncode}; the previous install is untouched.\n"
        f"--- last lines of {log_path} ---\n{tail}\n--- end of log tail ---"
    )
