"""The click CLI end to end (CliRunner): help everywhere, dry runs that run nothing, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from runner import __version__
from runner.cli import main


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a launcher config whose hooks dir holds a hook that leaves a mark."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "00_mark.sh").write_text(f'echo "$@" > {tmp_path}/hook-ran\n')
    (tmp_path / "launcher.yaml").write_text(f"hooks: {{dir: {hooks}}}\ncontainer: {{gpu: none}}\n")
    return tmp_path


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def test_version() -> None:
    res = _run("--version")
    assert res.exit_code == 0 and __version__ in res.output


def test_python_dash_m_runner_is_primus_cli() -> None:
    """A checkout that is not pip-installed (a GPU box) runs the launcher as `python -m runner`."""
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-m", "runner", "--version"], cwd=root, capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.strip() == f"primus-cli, version {__version__}"


@pytest.mark.parametrize(
    "args",
    [
        ["--help"], ["direct", "--help"], ["container", "--help"], ["slurm", "--help"],
        ["slurm", "srun", "-N", "2", "--", "container", "--help"], ["config", "--help"],
        ["config", "show", "--help"], ["template", "--help"], ["template", "render", "--help"],
    ],
    ids=lambda a: "-".join(a),
)  # fmt: skip
def test_help_on_every_level(args: list[str]) -> None:
    res = _run(*args)
    assert res.exit_code == 0, res.output
    assert "Usage:" in res.output


@pytest.mark.parametrize(
    "args",
    [
        ["--dry-run", "direct", "--", "--script", "a.py"],
        ["direct", "--dry-run", "--", "--script", "a.py"],
        ["direct", "--", "--script", "a.py"],  # main.dry_run from the config below
        ["--dry-run", "container", "--image", "i", "--", "--script", "a.py"],
        ["container", "--image", "i", "--dry-run", "--", "--script", "a.py"],
        ["slurm", "--dry-run", "srun", "-N", "2", "--", "direct", "--", "--script", "a.py"],
        ["slurm", "sbatch", "-N", "2", "--dry-run", "--", "container", "--", "--script", "a.py"],
        ["--plan-json", "slurm", "srun", "--", "--script", "a.py"],
    ],
    ids=["global", "direct", "config", "global-container", "container", "slurm", "slurm-flags", "plan-json"],
)
def test_dry_run_anywhere_before_the_command_runs_nothing(workdir: Path, args: list[str]) -> None:
    cfg = workdir / "launcher.yaml"
    if args == ["direct", "--", "--script", "a.py"]:
        cfg.write_text(cfg.read_text() + "main: {dry_run: true}\n")
    res = _run("--config", str(cfg), *args)
    assert res.exit_code == 0, res.output
    assert not (workdir / "hook-ran").exists()
    assert not (workdir / "logs").exists()
    assert "00_mark.sh" in res.output


def test_dry_run_calls_only_hooks_that_declare_support_with_dry_run_first(workdir: Path) -> None:
    (workdir / "hooks" / "01_plan.sh").write_text(
        f'# primus-hook: dry-run-ok\necho "$1" > {workdir}/planned\n'
    )
    res = _run("--config", str(workdir / "launcher.yaml"), "--dry-run", "direct", "--", "--script", "a.py")
    assert res.exit_code == 0
    assert (workdir / "planned").read_text().strip() == "--dry-run"
    assert not (workdir / "hook-ran").exists()


def test_plan_json_is_the_plan(workdir: Path) -> None:
    res = _run(
        "--config",
        str(workdir / "launcher.yaml"),
        "--plan-json",
        "slurm",
        "srun",
        "-N",
        "2",
        "--",
        "--script",
        "a.py",
    )
    plan = json.loads(res.output)
    assert [s["kind"] for s in plan["steps"]] == ["srun", "container", "torchrun"]
    assert plan["steps"][0]["argv"][:3] == ["srun", "--job-name=primus", "--nodes=2"]


def test_secret_value_never_in_dry_run_output(workdir: Path) -> None:
    env = {"HF_TOKEN": "hf_SECRET_value_123", "WANDB_API_KEY": "wandb-SECRET-456"}
    res = _run("--config", str(workdir / "launcher.yaml"), "--dry-run", "container", "--image", "i",
               "--env", "MY_PW=pw-SECRET-789", "--", "--script", "a.py", env=env)  # fmt: skip
    assert res.exit_code == 0
    for secret in ("hf_SECRET_value_123", "wandb-SECRET-456", "pw-SECRET-789"):
        assert secret not in res.output
    assert "-e HF_TOKEN" in res.output and "-e WANDB_API_KEY" in res.output and "-e MY_PW" in res.output


@pytest.mark.parametrize(
    ("args", "code", "match"),
    [
        (["direct", "--imag", "x", "--", "--script", "a.py"], 2, "unknown option --imag"),
        (["slurm", "srun", "-N", "2", "direct"], 2, "missing '--'"),
        (["direct", "--", "python", "a.py"], 2, "unknown command 'python'"),
        (["--config", "missing.yaml", "direct", "--", "--script", "a.py"], 2, "cannot read"),
    ],
    ids=["option", "separator", "command", "config-file"],
)
def test_usage_errors_exit_2_with_the_remedy(workdir: Path, args: list[str], code: int, match: str) -> None:
    res = _run(*args)
    assert res.exit_code == code
    assert match in res.output


def test_unknown_config_key_suggests_the_close_one(workdir: Path) -> None:
    (workdir / ".primus.yaml").write_text("slurm: {job_nmae: x}\n")
    res = _run("config", "show")
    assert res.exit_code == 2
    assert "Did you mean 'slurm.job_name'" in res.output


def test_config_show_attributes_each_value(workdir: Path) -> None:
    (workdir / ".primus.yaml").write_text("slurm: {partition: cpu}\n")
    res = _run("config", "show", env={"DOCKER_IMAGE": "my/img:2"})
    lines = {line.split(":")[0]: line for line in res.output.splitlines()}
    assert lines["slurm.partition"].endswith(".primus.yaml")
    assert "my/img:2" in lines["container.image"] and lines["container.image"].endswith("# environment")


def test_failing_hook_stops_the_launch(workdir: Path) -> None:
    (workdir / "hooks" / "05_fail.sh").write_text('echo "cannot build"\nexit 4\n')
    (workdir / "job.py").write_text(f"open({str(workdir / 'trained')!r}, 'w')\n")
    res = _run("--config", str(workdir / "launcher.yaml"), "direct", "--", "--script", "job.py",
               env={"MASTER_PORT": "29555"})  # fmt: skip
    assert res.exit_code == 1
    assert "hook 05_fail.sh exited with code 4" in res.output and "cannot build" in res.output
    assert not (workdir / "trained").exists()


def test_template_list_and_render_to_file(workdir: Path) -> None:
    res = _run("template", "list")
    assert res.exit_code == 0 and {"ep8", "ep8-cudagraph", "pp8-8node"} <= set(res.output.split())
    out = workdir / "job.sh"
    res = _run(
        "template", "render", "pp8-8node", "-o", str(out), "--set", "nodes=2", "--set", "partition=cpu x"
    )
    assert res.exit_code == 0 and res.output.strip() == str(out)
    assert "--partition 'cpu x'" in out.read_text() and out.stat().st_mode & 0o100


def test_skip_hook_is_shown_as_skipped_in_the_plan(workdir: Path) -> None:
    args = ["--config", str(workdir / "launcher.yaml"), "--dry-run", "direct", "--skip-hook", "00_mark", "--"]
    res = _run(*args, "--script", "a.py")
    assert res.exit_code == 0
    assert "00_mark.sh  [skipped]" in res.output


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--dry-run", "slurm", "srun", "-N", "abc", "--", "direct", "--", "--script", "a.py"],
         "Error: primus-cli slurm: -N abc: --nodes must be a positive integer (e.g. 2), got 'abc'."),
        (["--dry-run", "direct", "--gpus-per-node", "0", "--", "--script", "a.py"],
         "Error: primus-cli direct: --gpus-per-node 0: expected a positive integer."),
    ],
    ids=["slurm-nodes", "direct-gpus"],
)  # fmt: skip
def test_usage_error_is_one_line_naming_the_flag_and_value(workdir: Path, args: list[str], line: str) -> None:
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2
    assert res.output.splitlines() == [line]
