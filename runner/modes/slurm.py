"""slurm: start the rest of the chain once per node, with srun or with a rendered sbatch script.

Flags come from the launcher config, then the command line (which wins); `-N 4`, `--nodes 4` and
`--nodes=4` are the same flag, and no time limit is added. One task per node
(`--ntasks-per-node=1`) and `--kill-on-bad-exit=1`, so a failing node ends the step instead of
leaving the others waiting at the rendezvous. Each task runs `python -m runner.node`, which reads
the rest of the chain from PRIMUS_LAUNCH_REQUEST.

sbatch renders a batch script whose single batch step runs an inner `srun` on every node, logs to
`<slurm.log_dir>/%x-%j-node%n.out` with `--open-mode=append` (a requeued job appends).

Preemption: the job asks for `--signal=B:USR1@<slurm.signal_seconds>` and `--requeue`. The batch
script turns SIGUSR1 or SIGTERM sent to it into one SIGTERM to every process of its step, never
to srun itself, which answers SIGTERM by killing its tasks; the ranks save and exit 75, and the
script requeues the job, which resumes from that checkpoint. A `--signal` given by hand must be
one the batch script handles (B:USR1 or B:TERM) for sbatch, and TERM for srun: SIGUSR1 sent to
every process of a step kills torchrun before any rank saves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from runner import env as env_mod
from runner import templates
from runner.chain import Request
from runner.config import SlurmOpts
from runner.errors import ConfigError
from runner.host import HostFacts
from runner.plan import LaunchPlan, Step

SRUN_FIXED = ("--ntasks-per-node=1", "--kill-on-bad-exit=1")
_SIGNAL = re.compile(r"(?:(?P<where>[RB]+):)?(?:SIG)?(?P<sig>[A-Z0-9]+)(?:@\d+)?", re.IGNORECASE)
SAVES_ON = {"sbatch": ("USR1", "10", "TERM", "15"), "srun": ("TERM", "15")}
"""The signals a `--signal` may name: those that make the ranks save (see the module docstring)."""


def _flag(name: str, value: str | None) -> str:
    return f"--{name}" if value is None else f"--{name}={value}"


def log_dir(req: Request) -> Path:
    return Path(req.cwd) / req.config.slurm.log_dir


def check_signal(flags: dict[str, str | None], launcher: str) -> None:
    """A `--signal` given by hand must make the ranks save, not kill torchrun or the step."""
    if "signal" not in flags:
        return
    value = flags["signal"] or ""
    m = _SIGNAL.fullmatch(value)
    batch_only = m is not None and "B" in (m.group("where") or "").upper()
    if m and m.group("sig").upper() in SAVES_ON[launcher] and batch_only == (launcher == "sbatch"):
        return
    fix = (
        "--signal=B:USR1@<seconds> or set slurm.signal_seconds"
        if launcher == "sbatch"
        else "--signal=TERM@<seconds>"
    )
    raise ConfigError(
        f"slurm {launcher} --signal={value}: the ranks would not save (SIGUSR1 to every process of a step kills "
        f"torchrun; the batch script handles B:USR1 and B:TERM). Use {fix}."
    )


def _requeue(cfg: SlurmOpts, flags: dict[str, str | None]) -> bool:
    """`--no-requeue` on the command line or in extra_flags wins over slurm.requeue."""
    return "no-requeue" not in flags and (cfg.requeue or "requeue" in flags)


def sbatch_script(req: Request, host: HostFacts) -> str:
    """The batch script: #SBATCH flags, then an inner srun that starts one task per node and a
    preemption that saves and requeues (see the module docstring)."""
    logs, cfg = log_dir(req), req.config.slurm
    flags = dict(req.slurm_flags)
    flags.setdefault("job-name", cfg.job_name)
    flags.setdefault("output", str(logs / "%x-%j.out"))
    flags["open-mode"] = "append"
    requeue = _requeue(cfg, flags)
    if requeue:
        flags.setdefault("requeue", None)
    check_signal(flags, "sbatch")
    if cfg.signal_seconds and "signal" not in flags:
        flags["signal"] = f"B:USR1@{cfg.signal_seconds}"
    request = json.dumps(req.inner().to_dict(), sort_keys=True)
    return templates.render_file(
        "sbatch.sh.j2",
        sbatch_flags=[_flag(k, v) for k, v in flags.items()],
        cwd=req.cwd,
        request_var=env_mod.REQUEST_VAR,
        request_json=request,
        node_output=str(logs / "%x-%j-node%n.out"),
        python=host.python,
        requeue=requeue,
    )


def script_path(req: Request, host: HostFacts) -> str:
    return str(log_dir(req) / f"{req.config.slurm.job_name}-{host.job_id}.sbatch")


def build(req: Request, host: HostFacts, inner: LaunchPlan) -> LaunchPlan:
    """Prepend the srun or sbatch step to the per-node plan `inner`."""
    if req.launcher == "sbatch":
        path = script_path(req, host)
        step = Step(
            kind="sbatch",
            argv=("sbatch", "--parsable", path),
            where="here",
            env_names=(),
            script=sbatch_script(req, host),
        )
    else:
        check_signal(dict(req.slurm_flags), "srun")
        flags = tuple(_flag(k, v) for k, v in req.slurm_flags)
        step = Step(
            kind="srun",
            argv=("srun", *flags, *SRUN_FIXED, host.python, "-m", "runner.node"),
            where="here",
            env_names=(env_mod.REQUEST_VAR,),
        )
    return inner.wrapped_by(step)
