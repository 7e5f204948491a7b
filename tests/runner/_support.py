"""Build requests and plans the way the CLI does, from fixed host facts (no host dependence)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from runner import chain
from runner import config as config_mod
from runner.host import HostFacts
from runner.modes import build_plan
from runner.plan import LaunchPlan

CWD = "/work/job"


def host_facts(**overrides: object) -> HostFacts:
    values: dict = {
        "env": {"PATH": "/usr/bin"},
        "python": "/src/megamoe/.venv/bin/python",
        "hostname": "login1",
        "gpu_vendor": "amd",
        "visible_gpus": 8,
        "devices": frozenset({"/dev/kfd", "/dev/dri"}),
        "runtimes": ("podman",),
        "checkout": "/src/megamoe",
        "job_id": "job42",
        "resolves": lambda host: True,
        "free_port": lambda: 29400,
        "port_in_use": lambda port: False,
    }
    values.update(overrides)
    return HostFacts(**values)


def request(
    mode: str, tokens: list[str], *, config_file: Path | None = None, env: dict | None = None, cwd: str = CWD
):
    parsed = chain.parse_chain(mode, tokens)
    resolved = config_mod.resolve(
        home=None, cwd=Path("/nonexistent"), config_file=config_file, env_layer=[], cli_layer=parsed.cli_layer
    )
    return chain.make_request(parsed, resolved.config, env or {}, cwd=cwd)


def plan(mode: str, tokens: list[str], *, dry_run: bool = True, **host: object) -> LaunchPlan:
    facts = host_facts(**host)
    return build_plan(request(mode, tokens, env=dict(facts.env)), facts, dry_run=dry_run)[0]


# --------------------------------------------------------------------------- real launches

PRIMUS_CLI = str(Path(sys.executable).parent / "primus-cli")

ALLREDUCE = """\
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} world {dist.get_world_size()} sum {t.item()} args {sys.argv[1:]!r}", flush=True)
dist.destroy_process_group()
"""


def job_env(base: dict[str, str], **extra: str) -> dict[str, str]:
    """A clean environment for a real launch: 2 processes per node, no inherited rendezvous."""
    env = {k: v for k, v in base.items() if not k.startswith(("SLURM_", "MASTER_", "PRIMUS_"))}
    for name in ("NNODES", "NODE_RANK", "GPUS_PER_NODE"):
        env.pop(name, None)
    env.update({"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": "2", **extra})
    return env


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(
    args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PRIMUS_CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def processes_mentioning(token: str) -> list[str]:
    """Command lines (and environment-free) of live processes whose argv contains token."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if token in cmd:
            found.append(f"{proc.name}: {cmd}")
    return found
