"""Build requests and plans the way the CLI does, from fixed host facts (no host dependence)."""

from __future__ import annotations

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
