"""Run a plan: the only module that starts processes.

Every child runs in its own session; the launcher's SIGTERM, SIGUSR1 and SIGINT reach it as
runner.signals describes (torchrun's ranks save and exit 75 on a preemption), escalating to SIGKILL
after a grace period, so nothing is left behind. Values of environment variables are only ever
placed in a child's environment, never in argv or a log line.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from runner import env as env_mod
from runner import hooks as hooks_mod
from runner import signals
from runner.chain import Request
from runner.errors import LaunchError
from runner.modes import container as container_mod
from runner.modes.direct import NodeContext, in_slurm_step
from runner.plan import HookCall, LaunchPlan, Preflight, Step
from runner.torchrun_output import TorchrunOutput

logger = logging.getLogger(__name__)

TAIL_LINES = 20
PREFLIGHT_TIMEOUT_S = 120
_SRUN_TASK_EXIT = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): Exited with exit code (\d+)")


def _spawn(argv: list[str], env: Mapping[str, str], **kw: object) -> subprocess.Popen:
    try:
        return subprocess.Popen(argv, env=dict(env), start_new_session=True, **kw)  # type: ignore[call-overload]
    except FileNotFoundError as e:
        raise LaunchError(f"cannot run {argv[0]}: not found. Install it or check PATH.") from e


def _pump(
    stream: IO[str],
    proc: subprocess.Popen,
    on_line: Callable[[str], None],
    tick: Callable[[], None] = lambda: None,
) -> int:
    """Feed each line to on_line (reader thread) while waiting; return the exit status."""
    reader = threading.Thread(
        target=lambda: [on_line(line) for line in iter(stream.readline, "")], daemon=True
    )
    reader.start()
    while True:
        try:
            rc = proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            signals.tick()
            tick()
    reader.join(timeout=5)
    return rc


def run_passthrough(argv: list[str], env: Mapping[str, str]) -> int:
    """A child that writes straight to our stdout/stderr (the container client, a one-process command)."""
    logger.debug("running: %s", " ".join(argv[:2]))
    proc = _spawn(argv, env, stdin=subprocess.DEVNULL)
    with signals.forwarding(proc):
        while True:
            try:
                return signals.exit_code(proc.wait(timeout=0.5))
            except subprocess.TimeoutExpired:
                signals.tick()


# --------------------------------------------------------------------------- hooks


def run_hooks(
    calls: tuple[HookCall, ...], env: Mapping[str, str], timeout_s: int, python: str
) -> hooks_mod.HookOutput:
    """Run each hook in order; stop at the first failure with its name, exit code and output tail.

    Hooks see ``PRIMUS_PYTHON`` = the training's interpreter (unless the user set it), so a build hook
    installs for the Python that will import the result, not whatever ``python3`` is on PATH.
    """
    out = hooks_mod.HookOutput()
    for call in calls:
        argv = [*hooks_mod.interpreter(call.path, python), *call.argv]
        logger.debug("hook %s: running", call.name)
        tail: list[str] = []

        def on_line(line: str, name: str = call.name, tail: list[str] = tail) -> None:
            tail.append(line.rstrip("\n"))
            del tail[:-TAIL_LINES]
            out.add_line(name, line.rstrip("\n"))

        proc = _spawn(
            argv, {"PRIMUS_PYTHON": python, **env, **out.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        start = time.monotonic()
        with signals.forwarding(proc):
            assert proc.stdout is not None
            timer = _Timer(proc, start + timeout_s)
            rc = _pump(proc.stdout, proc, on_line, timer.check)
        if timer.fired:
            raise LaunchError(_hook_failure(call.name, f"timed out after {timeout_s} s", tail))
        if signals.received():
            raise LaunchError(f"hook {call.name}: stopped by {signal.Signals(signals.received()).name}")
        if rc != 0:
            raise LaunchError(_hook_failure(call.name, f"exited with code {rc}", tail))
        # A hook with nothing to say (one that is switched off) leaves no line on the console.
        level = logging.INFO if any(line.strip() for line in tail) else logging.DEBUG
        logger.log(level, "hook %s: done in %.1f s", call.name, time.monotonic() - start)
    return out


def preview_hooks(calls: tuple[HookCall, ...], env: Mapping[str, str], python: str) -> None:
    """Dry run: call only hooks that declare dry-run support, with `--dry-run` first."""
    for call in calls:
        if not call.dry_run_ok:
            continue
        argv = [*hooks_mod.interpreter(call.path, python), "--dry-run", *call.argv]
        try:
            res = subprocess.run(
                argv,
                env={"PRIMUS_PYTHON": python, **env},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except subprocess.TimeoutExpired:
            logger.warning("hook %s (dry run): no answer within 60 s", call.name)
            continue
        if res.returncode != 0:
            logger.warning("hook %s (dry run): exited with code %d", call.name, res.returncode)
        for line in (res.stdout + res.stderr).splitlines():
            logger.info("hook %s (dry run): %s", call.name, line)


class _Timer:
    def __init__(self, proc: subprocess.Popen, deadline: float) -> None:
        self.proc, self.deadline, self.fired = proc, deadline, False

    def check(self) -> None:
        if not self.fired and time.monotonic() > self.deadline:
            self.fired = True
            signals.killpg(self.proc, signal.SIGKILL)


def _hook_failure(name: str, what: str, tail: list[str]) -> str:
    body = "\n".join(f"    {line}" for line in tail) or "    (no output)"
    return (
        f"hook {name} {what}; the launch is stopped. Last output:\n{body}\nSkip it with --skip-hook {name}."
    )


# --------------------------------------------------------------------------- preflight, one process


def run_preflight(check: Preflight, env: Mapping[str, str], cwd: str) -> dict[str, Any] | None:
    """Run the trainer's config check; its JSON verdict, or None (with a warning) when it gave none."""
    logger.debug("preflight: %s", " ".join(check.argv))
    try:
        res = subprocess.run(
            list(check.argv), env=dict(env), cwd=cwd, capture_output=True, text=True,
            timeout=PREFLIGHT_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("preflight skipped: %s; the trainer checks its config when its ranks start", e)
        return None
    lines = res.stdout.strip().splitlines()
    with suppress(ValueError, IndexError):
        verdict = json.loads(lines[-1])
        if isinstance(verdict, dict) and res.returncode in (0, 2):
            return verdict
    last = (res.stderr.strip().splitlines() or ["no output"])[-1]
    logger.warning(
        "preflight gave no verdict (exit code %d: %s); the trainer checks its config when its ranks start",
        res.returncode, last,
    )  # fmt: skip
    return None


def run_python(plan: LaunchPlan, step: Step, req: Request, env: Mapping[str, str]) -> int:
    """Hooks, then the command once as one plain process (`train prepare-data ...`)."""
    out = run_hooks(plan.hooks, env, req.config.hooks.timeout_s, step.argv[0])
    logger.info("%s: one process on this node", req.command.name)
    return run_passthrough([*step.argv, *out.extra], {**env, **out.env})


# --------------------------------------------------------------------------- torchrun


def _torchrun_env(env: Mapping[str, str], exported: Mapping[str, str], ctx: NodeContext) -> dict[str, str]:
    """The workers' environment; OMP_NUM_THREADS=1 unless set (torchrun's own choice, minus its banner)."""
    child = {**env, **exported, **ctx.env(), "PYTHONUNBUFFERED": "1"}
    if int(ctx.nproc) > 1:
        child.setdefault("OMP_NUM_THREADS", "1")
    return child


def run_torchrun(plan: LaunchPlan, step: Step, ctx: NodeContext, req: Request, env: Mapping[str, str]) -> int:
    """Hooks, then torchrun; every line goes to the node log, the first and last rank to the console,
    and a failure is reported in one line (see torchrun_output)."""
    cfg = req.config
    out = run_hooks(plan.hooks, env, cfg.hooks.timeout_s, step.argv[0])
    argv = [*step.argv, *out.extra]
    log_path = Path(plan.log_file or "primus-node.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    output = TorchrunOutput(
        _console_ranks(cfg.direct.log_ranks, ctx), show_agent=logger.isEnabledFor(logging.DEBUG)
    )
    logger.info(
        "node %s/%s: torchrun with %s processes, master %s:%s; node log %s",
        ctx.node_rank, ctx.nnodes, ctx.nproc, ctx.master_addr, ctx.master_port, log_path,
    )  # fmt: skip
    with log_path.open("a", buffering=1) as log:
        proc = _spawn(
            argv,
            _torchrun_env(env, out.env, ctx),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )

        def on_line(line: str) -> None:
            log.write(line)
            if output.to_console(line):
                sys.stdout.write(line)
                sys.stdout.flush()

        with signals.forwarding(
            proc, torchrun_noticed=lambda: output.signalled, in_slurm_step=in_slurm_step(env)
        ):
            assert proc.stdout is not None
            rc = signals.exit_code(_pump(proc.stdout, proc, on_line))
    if rc == 0:
        return 0
    worker = output.worker_exit_code()  # the failing worker's code, not torchrun's 1
    if worker == signals.PREEMPTED_EXIT_CODE or (worker is None and output.saved is not None):
        logger.warning("%s", _preempted(output, str(log_path)))
        return signals.PREEMPTED_EXIT_CODE
    if signals.received():
        logger.error("stopped by %s (node log: %s)", signal.Signals(signals.received()).name, log_path)
        return rc
    logger.error("%s", output.summary(rc, str(log_path)))
    return worker or rc


def _preempted(output: TorchrunOutput, log: str) -> str:
    """The one line of a preempted run: why, where the ranks saved, how to go on."""
    got = signals.received()
    reason = output.saved.reason if output.saved else "stopped"
    reason = f"preempted ({signal.Signals(got).name})" if got else reason
    at = f" at iteration {output.saved.iteration}" if output.saved else ""
    return (
        f"{reason}: the ranks saved a checkpoint{at} and exited {signals.PREEMPTED_EXIT_CODE}; "
        f"run the same command again to resume from it (node log: {log})"
    )


def _console_ranks(mode: str, ctx: NodeContext) -> set[int] | None:
    """Local ranks whose lines reach the console: global rank 0 and the last global rank."""
    if mode == "all":
        return None
    ranks: set[int] = set()
    if int(ctx.node_rank) == 0:
        ranks.add(0)
    if int(ctx.node_rank) == int(ctx.nnodes) - 1:
        ranks.add(int(ctx.nproc) - 1)
    return ranks


# --------------------------------------------------------------------------- container


def clean_containers(rt: str) -> None:
    """Remove containers carrying our label (never anyone else's)."""
    list_argv, rm_argv = container_mod.clean_argv(rt)
    res = subprocess.run(list_argv, capture_output=True, text=True, check=False)
    ids = res.stdout.split()
    if ids:
        subprocess.run([*rm_argv, *ids], capture_output=True, check=False)
    logger.info("--clean: removed %d container(s) labelled %s", len(ids), container_mod.LABEL)


def run_container(step: Step, req: Request, ctx: NodeContext, env: Mapping[str, str]) -> int:
    if req.clean:
        clean_containers(step.argv[0])
    for path in container_mod.output_dirs(req):  # a runtime will not mount a directory that is missing
        path.mkdir(parents=True, exist_ok=True)
    child_env = {**env, **ctx.env(), env_mod.REQUEST_VAR: json.dumps(req.inner().to_dict())}
    logger.info("container %s: forwarding %d variables by name", step.argv[4], len(step.env_names))
    return run_passthrough(list(step.argv), child_env)


# --------------------------------------------------------------------------- slurm


def run_srun(step: Step, req: Request, env: Mapping[str, str]) -> int:
    """srun with the rest of the chain in PRIMUS_LAUNCH_REQUEST; report which node failed first."""
    child_env = {**env, env_mod.REQUEST_VAR: json.dumps(req.inner().to_dict())}
    failures: list[tuple[str, str, int]] = []

    def on_line(line: str) -> None:
        sys.stderr.write(line)
        m = _SRUN_TASK_EXIT.search(line)
        if m:
            failures.append((m.group(1), m.group(2), int(m.group(3))))

    proc = _spawn(list(step.argv), child_env, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    with signals.forwarding(proc):
        assert proc.stderr is not None
        rc = signals.exit_code(_pump(proc.stderr, proc, on_line))
    if rc == signals.PREEMPTED_EXIT_CODE:
        logger.warning("the ranks saved and exited %d (resumable); run the same command again to resume", rc)
        return rc
    if rc != 0 and failures and not signals.received():
        node, task, code = failures[0]
        logger.error(
            "node %s (task %s) failed first with exit code %d; srun returned %d", node, task, code, rc
        )
        return code
    return rc


def submit_sbatch(step: Step, env: Mapping[str, str]) -> str:
    """Write the batch script and submit it; return the job id."""
    path = Path(step.argv[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    assert step.script is not None
    path.write_text(step.script)
    res = subprocess.run(list(step.argv), env=dict(env), capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise LaunchError(f"sbatch failed (exit {res.returncode}): {res.stderr.strip()} (script: {path})")
    return res.stdout.strip().split(";")[0]


def follow(job_id: str, logs: list[Path], poll_s: float = 0.5) -> int:
    """Stream the job's log files until it leaves the queue; return its exit code."""
    offsets: dict[Path, int] = {}

    def drain() -> None:
        for pattern in logs:
            for path in sorted(pattern.parent.glob(pattern.name)):
                with path.open("rb") as f:
                    f.seek(offsets.get(path, 0))
                    data = f.read()
                    offsets[path] = f.tell()
                if data:
                    sys.stdout.write(data.decode(errors="replace"))
                    sys.stdout.flush()

    while True:
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, check=False)
        drain()
        if not queued.stdout.strip():
            break
        time.sleep(poll_s)
        if signals.received():
            logger.warning(
                "stopped following job %s (it keeps running; scancel %s to stop it)", job_id, job_id
            )
            return 128 + signals.received()
    time.sleep(poll_s)
    drain()
    show = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=False
    ).stdout
    m = re.search(r"JobState=(\S+).*?ExitCode=(\d+):(\d+)", show, re.S)
    if not m:
        logger.warning("job %s: no final state from scontrol", job_id)
        return 0
    state, code, sig = m.group(1), int(m.group(2)), int(m.group(3))
    logger.info("job %s finished: %s, exit code %d", job_id, state, code)
    return code or (128 + sig if sig else (0 if state == "COMPLETED" else 1))


def execute(plan: LaunchPlan, req: Request, ctx: NodeContext, env: Mapping[str, str]) -> int:
    """Run the outermost step (it starts the rest); return the training's exit code."""
    signals.prepare(env)
    first = plan.steps[0]
    if first.kind == "sbatch":
        job_id = submit_sbatch(first, env)
        sys.stdout.write(f"{job_id}\n")
        sys.stdout.flush()
        if not req.follow:
            return 0
        name = dict(req.slurm_flags).get("job-name") or req.config.slurm.job_name
        logs = Path(req.cwd) / req.config.slurm.log_dir
        return follow(job_id, [logs / f"{name}-{job_id}.out", logs / f"{name}-{job_id}-node*.out"])
    if first.kind == "srun":
        return run_srun(first, req, env)
    if first.kind == "container":
        return run_container(first, req, ctx, env)
    if first.kind == "python":
        return run_python(plan, first, req, env)
    return run_torchrun(plan, first, ctx, req, env)
