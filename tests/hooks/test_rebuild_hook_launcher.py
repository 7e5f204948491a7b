"""The rebuild hook run by primus-cli's hook engine: what it exports reaches the training process.

The seed command `REBUILD_PRIMUS_TURBO=1 PRIMUS_TURBO_REF=<sha> GPU_ARCHS=gfx950 primus-cli direct ...`
with a `--script` that prints its environment, against the fake upstream of conftest.py.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.hooks.rebuild_hook_helpers import REPO_ROOT, FakeTurbo, builds

PRIMUS_CLI = REPO_ROOT / ".venv" / "bin" / "primus-cli"
SCRIPT = Path(__file__).with_name("print_turbo_env.py")


def _launch(env: dict[str, str], tmp_path: Path, *global_opts: str) -> subprocess.CompletedProcess:
    # As with an activated venv: the hook builds with the `python3` that runs training.
    env = {**env, "PATH": f"{REPO_ROOT / '.venv' / 'bin'}:{env['PATH']}"}
    env.pop("PRIMUS_TURBO_PYTHON")
    argv = [
        str(PRIMUS_CLI),
        *global_opts,
        "direct",
        "--log-dir",
        str(tmp_path / "logs"),
        "--",
        "--script",
        str(SCRIPT),
    ]
    return subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def _seen(stdout: str) -> dict[str, str]:
    lines = [line.split("seen ", 1)[1] for line in stdout.splitlines() if "seen " in line]
    return dict(line.split("=", 1) for line in lines)


def test_rebuild_hook_through_primus_cli_direct_exports_what_it_promises(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    hook_env.update(PRIMUS_TURBO_REF=fake_turbo.newer, GPU_ARCHS="gfx950", PYTHONPATH="/opt/site-extra")
    done = _launch(hook_env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = _seen(done.stdout)
    install_dir = seen["PRIMUS_TURBO_INSTALL_DIR"]
    assert Path(install_dir).parent == Path(hook_env["PRIMUS_TURBO_BUILD_DIR"]) / "installs"
    assert seen["PYTHONPATH"] == f"{install_dir}:/opt/site-extra"  # the new build first, the rest kept
    assert seen["PRIMUS_TURBO_COMMIT"] == seen["primus_turbo.COMMIT"] == fake_turbo.newer
    assert seen["primus_turbo.__file__"] == f"{install_dir}/primus_turbo/__init__.py"
    assert Path(seen["PRIMUS_TURBO_WHEEL"]).is_file()
    assert "hook 00_rebuild_primus_turbo.sh: exports PYTHONPATH" in done.stderr
    again = _launch(hook_env, tmp_path)  # the next job on this node reuses the build
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[primus-turbo] up to date" in again.stderr
    assert _seen(again.stdout) == seen
    assert builds(hook_env) == [fake_turbo.newer]


def test_rebuild_hook_failure_stops_primus_cli_direct(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    hook_env["PRIMUS_TURBO_REF"] = fake_turbo.old
    done = _launch(hook_env, tmp_path)
    assert done.returncode != 0
    assert "hook 00_rebuild_primus_turbo.sh exited with code 2" in done.stderr
    assert "does not contain the minimum commit" in done.stderr
    assert "seen " not in done.stdout  # the training never started


def test_rebuild_hook_in_primus_cli_dry_run_changes_nothing(hook_env: dict[str, str], tmp_path: Path) -> None:
    done = _launch(hook_env, tmp_path, "--dry-run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hook 00_rebuild_primus_turbo.sh (dry run): [primus-turbo] dry run: would clone" in done.stderr
    assert not Path(hook_env["PRIMUS_TURBO_BUILD_DIR"]).exists()
    assert "seen " not in done.stdout


@pytest.mark.slurm
def test_rebuild_hook_on_every_node_of_a_slurm_job_builds_once(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path, slurm_env: dict[str, str]
) -> None:
    """`slurm srun -N 2`: the hook runs on both nodes. The fake nodes share one filesystem, as two
    jobs on one real node share /tmp, so the lock makes one node build and the other reuse it."""
    env = {k: v for k, v in hook_env.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(SLURM_CONF=slurm_env["SLURM_CONF"], GPUS_PER_NODE="1", FAKE_TURBO_BUILD_SLEEP="3")
    env["PATH"] = f"{REPO_ROOT / '.venv' / 'bin'}:{env['PATH']}"
    env.pop("PRIMUS_TURBO_PYTHON")
    argv = [str(PRIMUS_CLI), "slurm", "srun", "-N", "2", "--", "direct", "--", "--script", str(SCRIPT)]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    nodes_done = re.findall(r"\] INFO hook 00_rebuild_primus_turbo.sh: done in", done.stderr)
    assert len(nodes_done) == 2, done.stderr[-4000:]
    assert "waiting for the build already running" in done.stderr
    assert done.stderr.count("[primus-turbo] up to date") == 1
    assert done.stdout.count(f"seen primus_turbo.COMMIT={fake_turbo.minimum}") == 2  # both ranks
    assert builds(hook_env) == [fake_turbo.minimum]


@pytest.mark.parametrize("value", [None, "0"], ids=["unset", "zero"])
def test_rebuild_hook_off_leaves_no_line_on_the_console(tmp_path: Path, value: str | None) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PRIMUS_", "REBUILD_", "MASTER_", "SLURM_"))
    }
    env.update({"GPUS_PER_NODE": "1"} | ({"REBUILD_PRIMUS_TURBO": value} if value is not None else {}))
    job = tmp_path / "job.py"
    job.write_text("print('trained', flush=True)\n")
    argv = [str(PRIMUS_CLI), "direct", "--log-dir", str(tmp_path / "logs"), "--", "--script", str(job)]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained" in done.stdout
    assert "00_rebuild_primus_turbo" not in done.stderr and "primus-turbo" not in done.stderr
