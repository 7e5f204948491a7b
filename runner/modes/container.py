"""container: wrap the direct layer in `docker run` or `podman run` on each node.

The checkout is mounted at its own path and is the working directory; files the command names
outside it (`--script`, `--config`, `--input`, `--tokenizer-model`) are mounted read-only at their
own paths, and the directory of an `--output-prefix` read-write. Inside, the same
`python -m runner.node` runs the direct layer from the request in PRIMUS_LAUNCH_REQUEST. Every
variable crosses as `-e NAME` (the value comes from the runtime's environment, never argv).
Each container gets a unique name (job id and node rank) and our label; `--clean` removes only
containers that carry that label.
"""

from __future__ import annotations

import re
from pathlib import Path

from runner import env as env_mod
from runner.chain import Request
from runner.errors import ConfigError, LaunchError
from runner.host import HostFacts
from runner.modes.direct import NodeContext
from runner.plan import LaunchPlan, Step

LABEL = "io.megamoe.primus-cli"


def runtime(req: Request, host: HostFacts, warnings: list[str], *, dry_run: bool) -> str:
    wanted = req.config.container.runtime
    if wanted != "auto":
        if wanted not in host.runtimes:
            msg = f"container.runtime={wanted}: `{wanted}` is not installed or its daemon is not reachable here."
            if not dry_run:
                raise LaunchError(msg + " Install it, or pick another with --runtime docker|podman.")
            warnings.append(msg)
        return wanted
    if host.runtimes:
        return host.runtimes[0]
    msg = "no container runtime found (docker with a reachable daemon, or podman)"
    if not dry_run:
        raise LaunchError(msg + ". Install podman or docker, or use `direct` mode.")
    warnings.append(msg + "; showing docker")
    return "docker"


def gpu_flags(req: Request, host: HostFacts, rt: str, warnings: list[str], *, dry_run: bool) -> list[str]:
    """AMD: /dev/kfd, /dev/dri (and /dev/infiniband when present), group video. NVIDIA: all GPUs."""
    vendor = req.config.container.gpu
    if vendor == "auto" and host.gpu_vendor == "none" and dry_run:
        warnings.append(
            f"no container GPU flags: guessed from this host (no GPUs visible on {host.hostname}); "
            "set --gpu amd|nvidia for a GPU job"
        )
    vendor = host.gpu_vendor if vendor == "auto" else vendor
    if vendor == "amd":
        missing = [d for d in ("/dev/kfd", "/dev/dri") if d not in host.devices]
        if missing:
            msg = f"container.gpu=amd: {', '.join(missing)} missing on {host.hostname}"
            if not dry_run:
                raise LaunchError(msg + ". Run on a node with the ROCm driver loaded, or set --gpu none.")
            warnings.append(msg)
        flags = ["--device", "/dev/kfd", "--device", "/dev/dri"]
        if "/dev/infiniband" in host.devices:
            flags += ["--device", "/dev/infiniband"]
        return [*flags, "--group-add", "video"]
    if vendor == "nvidia":
        if "/dev/nvidiactl" not in host.devices:
            msg = f"container.gpu=nvidia: /dev/nvidiactl missing on {host.hostname}"
            if not dry_run:
                raise LaunchError(msg + ". Run on a node with the NVIDIA driver, or set --gpu none.")
            warnings.append(msg)
        return ["--gpus", "all"] if rt == "docker" else ["--device", "nvidia.com/gpu=all"]
    return []


def output_dirs(req: Request) -> list[Path]:
    """Directories the command writes to, as absolute paths (the launch creates them first)."""
    return [(Path(req.cwd) / name).resolve() for name in req.command.output_dirs()]


def _mounts(req: Request, host: HostFacts) -> list[str]:
    """The checkout and the working directory at their own paths; outside them, the files the command
    reads read-only and the directories it writes read-write."""
    roots = list(dict.fromkeys(Path(p).resolve() for p in (host.checkout, req.cwd)))
    roots = [r for r in roots if not any(r != o and r.is_relative_to(o) for o in roots)]
    flags = [a for r in roots for a in ("-v", f"{r}:{r}")]
    for name in req.command.files():
        path = (Path(req.cwd) / name).resolve()
        if not any(path.is_relative_to(r) for r in roots):
            flags += ["-v", f"{path}:{path}:ro"]
    for path in output_dirs(req):
        if not any(path.is_relative_to(r) for r in roots):
            flags += ["-v", f"{path}:{path}"]
    for vol in (*req.config.container.volumes, *req.volumes):
        flags += ["-v", vol]
    return flags


def _ulimits(configured: list[str], cli: tuple[str, ...]) -> list[str]:
    """Configured limits, then the command line's; a later value replaces one of the same type."""
    merged: dict[str, str] = {}
    for limit in (*configured, *cli):
        kind, eq, _ = limit.partition("=")
        if not eq:
            raise ConfigError(f"--ulimit {limit!r}: expected type=soft[:hard], e.g. nofile=1048576:1048576.")
        merged[kind] = limit
    return list(merged.values())


def container_python(req: Request, host: HostFacts) -> str:
    """The interpreter inside the image: configured, else ours if a mount brings it, else python3."""
    if req.config.container.python:
        return req.config.container.python
    if any(Path(host.python).is_relative_to(Path(p)) for p in (host.checkout, req.cwd)):
        return host.python
    return "python3"


def name(req: Request, ctx: NodeContext) -> str:
    raw = f"{req.config.container.name_prefix}-{ctx.job_id}-node{ctx.node_rank}"
    if "<" in raw:  # a dry run's placeholder: show it as is
        return raw
    return re.sub(r"[^a-zA-Z0-9_.-]+", "_", raw).strip("_")


def build(
    req: Request, host: HostFacts, ctx: NodeContext, inner: LaunchPlan, *, dry_run: bool, where: str
) -> LaunchPlan:
    """Prepend the container step to the direct layer `inner` (built for inside the container)."""
    c = req.config.container
    warnings: list[str] = []
    rt = runtime(req, host, warnings, dry_run=dry_run)
    names = env_mod.forwarded_names(
        req.config.env, host.env, (*req.env_names, *env_mod.DISTRIBUTED_VARS, env_mod.REQUEST_VAR)
    )
    argv = [
        rt,
        "run",
        "--rm",
        "--name",
        name(req, ctx),
        "--label",
        f"{LABEL}=1",
        "--label",
        f"{LABEL}.job={ctx.job_id}",
    ]
    argv += [f"--ipc={c.ipc}", f"--network={c.network}"]
    if c.ipc != "host" and c.shm_size:
        argv += [f"--shm-size={c.shm_size}"]
    for limit in _ulimits(c.ulimits, req.ulimits):
        argv += ["--ulimit", limit]
    argv += ["--privileged"] if c.privileged else []
    for cap in c.cap_add:
        argv += ["--cap-add", cap]
    for opt in c.security_opt:
        argv += ["--security-opt", opt]
    argv += gpu_flags(req, host, rt, warnings, dry_run=dry_run)
    for dev in (*c.devices, *req.devices):
        argv += ["--device", dev]
    argv += _mounts(req, host)
    argv += ["-w", str(Path(req.cwd).resolve())]
    for n in names:
        argv += ["-e", n]
    argv += [c.image, container_python(req, host), "-m", "runner.node"]
    step = Step(kind="container", argv=tuple(argv), where=where, env_names=names)
    return inner.wrapped_by(step, tuple(warnings))


def clean_argv(rt: str) -> tuple[list[str], list[str]]:
    """(list our containers, remove them): only containers carrying our label are touched."""
    return [rt, "ps", "-aq", "--filter", f"label={LABEL}=1"], [rt, "rm", "-f"]
