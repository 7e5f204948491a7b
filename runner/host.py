"""Facts about the machine, gathered once and passed to the pure plan builders.

A dry run and a test build the same plan from the same facts; tests construct `HostFacts` by hand.
Nothing here starts a process (`execute.py` is the only module that does); the port helpers only
bind a socket and close it.
"""

from __future__ import annotations

import errno
import glob
import importlib.util
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEVICE_PATHS = ("/dev/kfd", "/dev/dri", "/dev/infiniband", "/dev/nvidiactl")


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


def _free_port() -> int:
    """A port nobody listens on now: the kernel's pick for a socket bound to port 0."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    """True when binding the port fails as torchrun's store would (SO_REUSEADDR: TIME_WAIT is free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _trainer_importable() -> bool:
    """megamoe and torch can be imported by this interpreter (looked up, not imported)."""
    return all(importlib.util.find_spec(name) is not None for name in ("megamoe", "torch"))


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    env: Mapping[str, str]
    """The launcher's environment (read for names and the distributed settings, never printed)."""
    python: str
    """The interpreter running the launcher; the nodes run `python -m runner.node` with it."""
    hostname: str = "localhost"
    gpu_vendor: str = "none"
    """amd, nvidia or none."""
    visible_gpus: int = 0
    devices: frozenset[str] = frozenset()
    """Which of DEVICE_PATHS exist here."""
    runtimes: tuple[str, ...] = ()
    """Usable container runtimes, preferred first."""
    checkout: str = "/"
    """The checkout holding the `runner` package: mounted into containers, home of hooks/."""
    job_id: str = "local"
    """PRIMUS_JOB_ID (set for the layer inside a container), SLURM_JOB_ID, or a timestamp and pid:
    names logs and containers uniquely."""
    trainer_importable: bool = True
    """`python -m megamoe.train` can run here: the preflight config check runs on this host."""
    resolves: Callable[[str], bool] = field(default=_resolves, compare=False)
    free_port: Callable[[], int] = field(default=_free_port, compare=False)
    port_in_use: Callable[[int], bool] = field(default=_port_in_use, compare=False)


def _count_visible(env: Mapping[str, str]) -> tuple[str, int]:
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        if var in env:
            ids = [v for v in env[var].split(",") if v.strip() and v.strip() != "-1"]
            return ("nvidia" if var.startswith("CUDA") else "amd"), len(ids)
    if os.path.exists("/dev/kfd"):
        return "amd", len(glob.glob("/dev/dri/renderD*"))
    nvidia = [p for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia") :].isdigit()]
    if nvidia:
        return "nvidia", len(nvidia)
    return "none", 0


def _runtimes(env: Mapping[str, str]) -> tuple[str, ...]:
    """docker when its daemon is reachable, podman when installed; docker CLI alone is last."""
    have_docker = shutil.which("docker") is not None
    docker_daemon = have_docker and (
        "DOCKER_HOST" in env or os.path.exists("/var/run/docker.sock") or os.path.exists("/run/docker.sock")
    )
    out = ["docker"] if docker_daemon else []
    if shutil.which("podman"):
        out.append("podman")
    if have_docker and not docker_daemon:
        out.append("docker")
    return tuple(out)


def gather(env: Mapping[str, str] | None = None) -> HostFacts:
    env = dict(os.environ if env is None else env)
    vendor, count = _count_visible(env)
    job_id = (
        env.get("PRIMUS_JOB_ID")
        or env.get("SLURM_JOB_ID")
        or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    )
    return HostFacts(
        env=env,
        python=sys.executable,
        hostname=socket.gethostname(),
        gpu_vendor=vendor,
        visible_gpus=count,
        devices=frozenset(p for p in DEVICE_PATHS if os.path.exists(p)),
        runtimes=_runtimes(env),
        checkout=str(Path(__file__).resolve().parent.parent),
        job_id=job_id,
        trainer_importable=_trainer_importable(),
    )


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`node[1-3,7],gpu05`) in order, like `scontrol show hostnames`."""
    hosts: list[str] = []
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    parts.append(nodelist[start:])
    for part in filter(None, parts):
        if "[" not in part:
            hosts.append(part)
            continue
        prefix, _, rest = part.partition("[")
        ranges, _, suffix = rest.partition("]")
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts += [h + tail for h in [prefix + lo] for tail in expand_nodelist(suffix) or [""]]
                continue
            for n in range(int(lo), int(hi) + 1):
                hosts += [f"{prefix}{n:0{len(lo)}d}{tail}" for tail in expand_nodelist(suffix) or [""]]
    return hosts
