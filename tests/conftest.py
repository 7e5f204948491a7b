"""Shared fixtures. Markers `slurm` and `container` bring up the real services' handles.

`make integration-infra` (tests/integration/infra/setup.sh) starts the local Slurm cluster and
builds the base image, and writes $MEGAMOE_INFRA_DIR/env (SLURM_CONF=..., CONTAINERS_CONF=...).
Without it a marked test is skipped with the reason; in CI (MEGAMOE_CI=1) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

INFRA_ENV = Path(os.environ.get("MEGAMOE_INFRA_DIR", "/tmp/megamoe-infra")) / "env"
BASE_IMAGE = "localhost/megamoe-base:ci"


def _missing(reason: str) -> None:
    if os.environ.get("MEGAMOE_CI") == "1":
        pytest.fail(f"{reason} (MEGAMOE_CI=1: a missing resource fails). Run `make integration-infra`.")
    pytest.skip(f"{reason}; run `make integration-infra` (as root) to start it")


@pytest.fixture(scope="session")
def infra_env() -> dict[str, str]:
    """The variables the infra script recorded (SLURM_CONF, CONTAINERS_CONF)."""
    if not INFRA_ENV.is_file():
        return {}
    pairs = (line.split("=", 1) for line in INFRA_ENV.read_text().splitlines() if "=" in line)
    return {k: v for k, v in pairs}


@pytest.fixture(scope="session")
def slurm_env(infra_env: dict[str, str]) -> dict[str, str]:
    """Environment for talking to the local Slurm cluster (2 idle nodes checked)."""
    env = {**os.environ, **{k: v for k, v in infra_env.items() if k == "SLURM_CONF"}}
    if shutil.which("sinfo") is None or "SLURM_CONF" not in env:
        _missing("the local Slurm cluster is not set up")
    res = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, timeout=30
    )
    nodes = [line for line in res.stdout.splitlines() if line.split()[-1] in ("idle", "mixed", "allocated")]
    if res.returncode != 0 or len(nodes) < 2:
        _missing(f"the local Slurm cluster is not up (sinfo: {res.stdout.strip() or res.stderr.strip()})")
    return env


@pytest.fixture(scope="session")
def container_env(infra_env: dict[str, str]) -> dict[str, str]:
    """Environment for podman with the base image present."""
    env = {**os.environ, **{k: v for k, v in infra_env.items() if k == "CONTAINERS_CONF"}}
    if shutil.which("podman") is None:
        _missing("podman is not installed")
    res = subprocess.run(["podman", "image", "exists", BASE_IMAGE], env=env, capture_output=True, timeout=60)
    if res.returncode != 0:
        _missing(f"the base image {BASE_IMAGE} is not built")
    return env


@pytest.fixture(autouse=True)
def _marked_services(request: pytest.FixtureRequest) -> None:
    """A test marked `slurm` or `container` gets its service checked before it runs."""
    if request.node.get_closest_marker("slurm"):
        request.getfixturevalue("slurm_env")
    if request.node.get_closest_marker("container"):
        request.getfixturevalue("container_env")
