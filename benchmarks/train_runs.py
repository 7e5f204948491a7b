"""What the end-to-end training benchmarks share: launching ``train pretrain`` and reading it back.

* :func:`runner_argv` builds ``python -m runner direct --log-dir D -- train pretrain ...`` (the launcher
  as a module, so a checkout runs it without a pip install); :func:`launch_env` sets the node's ranks
  (``GPUS_PER_NODE``), the job id that names the node log, and a free ``MASTER_PORT``.
* :func:`run_logged` runs one command in its own process group under a timeout, echoing its output
  and saving it to a console log; on a timeout it stops the whole group.
* :class:`RunRecord`: one launch and what was read back (the scripts' result records extend it).
* :func:`parse_summary` / :func:`parse_moe_block` read the trainer's closing ``summary:`` line and its
  ``MoE block:`` line back from that console log; :func:`read_training_log` reads the trainer's
  ``training_log.jsonl`` (``megamoe/train/sinks.py``): the per-iteration and evaluation records of
  the last launch into that workspace.
* :func:`split_overrides`: a script's own arguments and the trainer overrides after ``--``.
* :func:`versions`, :func:`machine`, :func:`commit`: what a results file records about the run.

Every command is an argument list; no value is ever evaluated by a shell.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RunSummary:
    """The trainer's ``summary:`` line (``megamoe.train.loop.Summary.text``), parsed; iterations as
    printed (``trained iterations 1..15``), numbers to the digits printed."""

    first_iteration: int
    last_iteration: int
    first_loss: float | None
    last_loss: float | None
    step_ms: float | None
    tokens_per_s: float | None
    tflops_per_gpu: float | None
    peak_mem_gib: float


_NUM = r"(n/a|[-+0-9.,eEinfa]+)"
SUMMARY_RE = re.compile(
    rf"summary: trained iterations (\d+)\.\.(\d+) \| lm loss {_NUM} -> {_NUM} \| step {_NUM} ms \| "
    rf"{_NUM} tokens/s \| {_NUM} TFLOP/s/GPU \| peak mem {_NUM} GiB"
)
MOE_BLOCK_RE = re.compile(r"MoE block: (MegaMoE|megatron-core MoELayer) \((.*)\)\s*$", re.MULTILINE)


@dataclass(kw_only=True)
class RunRecord:
    """One ``train pretrain`` launch: its command, how it ended, what its console log says, and the
    problems a script's check found (none: ``ok``)."""

    command: list[str] = field(default_factory=list)
    console_log: str = ""
    returncode: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    timeout_s: float = 0.0
    moe_block: str | None = None
    moe_reason: str | None = None
    summary: RunSummary | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def read_console(self, text: str) -> None:
        """The ``MoE block:`` and ``summary:`` lines of the console output ``text``."""
        block = parse_moe_block(text)
        self.moe_block, self.moe_reason = block if block else (None, None)
        self.summary = parse_summary(text)


def _number(text: str) -> float | None:
    return None if text == "n/a" else float(text.replace(",", ""))


def parse_summary(text: str) -> RunSummary | None:
    """The last ``summary: trained iterations ...`` line in ``text`` (None when there is none)."""
    matches = SUMMARY_RE.findall(text)
    if not matches:
        return None
    first, last, loss0, loss1, step, tokens, tflops, mem = matches[-1]
    peak = _number(mem)
    return RunSummary(
        first_iteration=int(first),
        last_iteration=int(last),
        first_loss=_number(loss0),
        last_loss=_number(loss1),
        step_ms=_number(step),
        tokens_per_s=_number(tokens),
        tflops_per_gpu=_number(tflops),
        peak_mem_gib=0.0 if peak is None else peak,
    )


def parse_moe_block(text: str) -> tuple[str, str] | None:
    """``(block, reason)`` from the trainer's last ``MoE block: <block> (<reason>)`` line."""
    matches = MOE_BLOCK_RE.findall(text)
    return matches[-1] if matches else None


@dataclass(frozen=True)
class TrainingLog:
    """The records of the last launch in one ``training_log.jsonl`` (after its last ``run_start``)."""

    train: tuple[dict[str, Any], ...]
    """One per iteration: ``iteration``, ``lm_loss``, ``aux_loss``, ``lr``, ``grad_norm``, ``seconds``, ..."""
    valid: tuple[dict[str, Any], ...]
    """One per evaluation of the validation split: ``iteration``, ``lm_loss``, ``ppl``."""
    test: tuple[dict[str, Any], ...]
    unreadable_lines: int = 0
    """Lines that are not JSON (a run killed mid-write leaves a cut last line)."""


def read_training_log(path: Path) -> TrainingLog:
    """Read ``path``; a workspace trained into twice appends, so only the last launch's records count."""
    records: list[dict[str, Any]] = []
    bad = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if record.get("event") == "run_start":
            records = []
        records.append(record)
    by_event: dict[str, list[dict[str, Any]]] = {"train": [], "valid": [], "test": []}
    for record in records:
        by_event.get(record.get("event", ""), []).append(record)
    return TrainingLog(
        train=tuple(by_event["train"]),
        valid=tuple(by_event["valid"]),
        test=tuple(by_event["test"]),
        unreadable_lines=bad,
    )


def find_training_log(workspace: Path) -> Path | None:
    """The newest ``training_log.jsonl`` under ``workspace`` (the trainer writes it into
    ``<workspace>/<work_group>/<user_name>/<exp_name>/``)."""
    if not workspace.is_dir():
        return None
    logs = sorted(workspace.rglob("training_log.jsonl"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runner_argv(python: str, log_dir: Path, trainer_args: Sequence[str]) -> list[str]:
    """``<python> -m runner direct --log-dir <log_dir> -- train pretrain <trainer_args>``."""
    launcher = [python, "-m", "runner", "direct", "--log-dir", str(log_dir), "--"]
    return [*launcher, "train", "pretrain", *trainer_args]


def launch_env(base: dict[str, str], job_id: str, gpus: int) -> dict[str, str]:
    """``base`` plus the node's ranks, the job id (the node log is ``<log_dir>/<job_id>-node0.log``),
    unbuffered output and a free ``MASTER_PORT`` unless one is set."""
    env = dict(base)
    env["GPUS_PER_NODE"] = str(gpus)
    env["PRIMUS_JOB_ID"] = job_id
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MASTER_PORT", str(free_port()))
    return env


def run_logged(
    argv: list[str], env: dict[str, str], console_log: Path, timeout_s: float
) -> tuple[int | None, bool, float]:
    """Run one command in its own process group, echoing and saving its output; (status, timed out, s).
    However it ends (timeout, ``KeyboardInterrupt``), the group is stopped before this returns."""
    started = time.monotonic()
    timed_out = False
    with console_log.open("w") as log:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", start_new_session=True, bufsize=1,
        )  # fmt: skip

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            terminate(proc)
        finally:
            if proc.poll() is None:
                terminate(proc)
            reader.join(timeout=30)
        if timed_out:
            log.write(f"\n[bench] timed out after {timeout_s:.0f} s: stopped\n")
    return proc.returncode, timed_out, time.monotonic() - started


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM to the launcher's process group (primus-cli forwards it to torchrun and kills after 20 s)."""
    for sig, wait in ((signal.SIGTERM, 40), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "triton", "megatron-core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def machine() -> str:
    if shutil.which("nvidia-smi"):
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if res.returncode == 0 and res.stdout.strip():
            names = res.stdout.strip().splitlines()
            return f"{len(names)} x {names[0]}"
    return f"CPU ({os.cpu_count()} cores)"


def commit() -> str:
    """The checkout's commit, with ``-dirty`` when the tree differs from it (a copied tree may carry an
    older ``.git``)."""
    res = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=7"],
        capture_output=True,
        text=True,
    )
    return res.stdout.strip() if res.returncode == 0 else "unknown"


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(the script's own arguments, the trainer overrides after --)``."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
