"""`images/build.sh`: its dry run, and the errors it gives before any build starts (no runtime needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import BASE_IMAGE

REPO = Path(__file__).resolve().parents[3]
BUILD = REPO / "images" / "build.sh"


def _build_sh(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("BASE_IMAGE", "IMAGE", "PRIMUS_TURBO_REPO_URL")
    }
    full_env["CONTAINER_RUNTIME"] = "podman"  # a dry run only names it: the same with or without podman
    full_env.update(env)
    return subprocess.run(["bash", str(BUILD), *args], env=full_env, capture_output=True, text=True, cwd=REPO)


@pytest.mark.parametrize("kind", ["cpu", "cuda", "rocm"])
def test_build_script_dry_run_prints_every_step(kind: str) -> None:
    done = _build_sh(kind, "--dry-run", "--", "--no-cache", BASE_IMAGE="localhost/base:1")
    assert done.returncode == 0, done.stderr
    lines = [line[2:] for line in done.stderr.splitlines() if line.startswith("+ ")]
    assert lines[-1 if kind != "cpu" else -2].startswith(
        f"podman build --tag localhost/megamoe-{kind}:latest --file {REPO}/build/images/{kind}/Dockerfile "
        "--build-arg BASE_IMAGE=localhost/base:1 --no-cache"
    )
    assert any(
        f"pip wheel --quiet --no-deps --wheel-dir {REPO}/build/images/{kind}/wheels {REPO}" in line
        for line in lines
    )
    assert (kind == "cpu") == any("torch==2.13.0" in line for line in lines)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["gpu"], {}, "kind=gpu: not an image of this repo. Use one of: cpu, cuda, rocm"),
        (["cpu", "--fast"], {}, "argument --fast: unknown. Put build options after --"),
        (["cpu"], {"CONTAINER_RUNTIME": "lxc"}, "CONTAINER_RUNTIME=lxc: expected podman or docker"),
        (
            ["rocm", "--dry-run"],  # the dry run checks it too, with or without a runtime here
            {"PRIMUS_TURBO_REPO_URL": "https://bob:t0ken@example.invalid/x.git"},
            "PRIMUS_TURBO_REPO_URL: has credentials",
        ),
    ],
)
def test_build_script_bad_input_names_the_setting(args: list[str], env: dict[str, str], message: str) -> None:
    done = _build_sh(*args, **env)
    assert done.returncode == 2
    assert message in done.stderr
    assert "t0ken" not in done.stderr


@pytest.mark.container
def test_build_script_refuses_a_wheelhouse_python_unlike_the_image(
    container_env: dict[str, str], tmp_path: Path
) -> None:
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 3.12\n")  # answers the version probe only
    fake_python.chmod(0o755)
    env = {
        **container_env,
        "BASE_IMAGE": BASE_IMAGE,
        "PYTHON": str(fake_python),
        "CONTAINER_RUNTIME": "podman",
    }
    done = subprocess.run(["bash", str(BUILD), "cpu"], env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2
    assert f"PYTHON={fake_python}: is Python 3.12 but {BASE_IMAGE} has 3.11" in done.stderr
    assert "pip wheel" not in done.stderr  # refused before any work
