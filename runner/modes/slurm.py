"""slurm: start the rest of the chain once per node, with srun or with a rendered sbatch script.

Flags come from the launcher config, then the command line (which wins); `-N 4`, `--nodes 4` and
`--nodes=4` are the same flag, and no time limit is added. One task per node
(`--ntasks-per-node=1`) and `--kill-on-bad-exit=1`, so a failing node ends the step instead of
leaving the others waiting at the rendezvous. Each task runs `python -m runner.node`, which reads
the rest of the chain from PRIMUS_LAUNCH_REQUEST.

sbatch renders a batch script whose single batch step runs an inner `srun` on every node, logs to
`<slurm.log_dir>/%x-%j-node%n.out` with `--open-mode=append` (a requeued job appends).
"""

from __future__ import annotations

import json
from pathlib import Path

from runner import env as env_mod
from runner import templates
from runner.chain import Request
from runner.host import HostFacts
from runner.plan import LaunchPlan, Step

SRUN_FIXED = ("--ntasks-per-node=1", "--kill-on-bad-exit=1")


def _flag(name: str, value: str | None) -> str:
    return f"--{name}" if value is None else f"--{name}={value}"


def log_dir(req: Request) -> Path:
    return Path(req.cwd) / req.config.slurm.log_dir


def sbatch_script(req: Request, host: HostFacts) -> str:
    """The batch script: #SBATCH flags, then an inner srun that starts one task per node."""
    logs = log_dir(req)
    flags = dict(req.slurm_flags)
    flags.setdefault("job-name", req.config.slurm.job_name)
    flags.setdefault("output", str(logs / "%x-%j.out"))
    flags["open-mode"] = "append"
    request = json.dumps(req.inner().to_dict(), sort_keys=True)
    return templates.render_file(
        "sbatch.sh.j2",
        sbatch_flags=[_flag(k, v) for k, v in flags.items()],
        cwd=req.cwd,
        request_var=env_mod.REQUEST_VAR,
        request_json=request,
        node_output=str(logs / "%x-%j-node%n.out"),
        python=host.python,
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
        flags = tuple(_flag(k, v) for k, v in req.slurm_flags)
        step = Step(
            kind="srun",
            argv=("srun", *flags, *SRUN_FIXED, host.python, "-m", "runner.node"),
            where="here",
            env_names=(env_mod.REQUEST_VAR,),
        )
    return inner.wrapped_by(step)
