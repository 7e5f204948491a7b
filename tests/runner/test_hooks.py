"""Hooks run for real (bash and python): order, protocol, skipping, failure and timeout reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runner import execute, hooks
from runner.errors import LaunchError


def _hook(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


@pytest.fixture
def hook_dir(tmp_path: Path) -> Path:
    d = tmp_path / "hooks"
    _hook(d / "10_b.sh", 'echo "progress from b"\necho "env.FROM_B=$1-$2"\n')
    _hook(
        d / "02_a.py", "import sys\nprint('extra.backend_path=/opt/x')\nprint('env.FROM_A=' + sys.argv[1])\n"
    )
    _hook(d / "train" / "pretrain" / "00_c.sh", 'echo "env.FROM_C=${FROM_B}"\n')
    _hook(d / "train" / "posttrain" / "00_d.sh", "exit 9\n")
    _hook(d / "README.md", "not a hook\n")
    return d


ARGV = ("train", "pretrain", "--config", "x.yaml")


def test_discover_global_sorted_then_command_group(hook_dir: Path) -> None:
    calls, skipped = hooks.discover(hook_dir, ("train", "pretrain"), ARGV, [])
    assert [c.name for c in calls] == ["02_a.py", "10_b.sh", "train/pretrain/00_c.sh"]
    assert skipped == ()


@pytest.mark.parametrize("skip", [["10_b"], ["10_b.sh"], [" 10_b ", ""]])
def test_discover_skip_by_name_with_or_without_extension(hook_dir: Path, skip: list[str]) -> None:
    calls, skipped = hooks.discover(hook_dir, ("train", "pretrain"), ARGV, skip)
    assert "10_b.sh" not in [c.name for c in calls]
    assert skipped == ("10_b.sh",)


def test_run_hooks_protocol_exports_env_and_extras_in_order(hook_dir: Path) -> None:
    calls, _ = hooks.discover(hook_dir, ("train", "pretrain"), ARGV, [])
    out = execute.run_hooks(calls, {"PATH": "/usr/bin:/bin"}, timeout_s=30, python=sys.executable)
    assert out.env == {"FROM_A": "train", "FROM_B": "train-pretrain", "FROM_C": "train-pretrain"}
    assert out.extra == ["--backend_path", "/opt/x"]


def test_run_hooks_failure_names_hook_exit_code_and_output_tail(tmp_path: Path) -> None:
    d = tmp_path / "hooks"
    _hook(d / "00_ok.sh", "true\n")
    _hook(d / "01_bad.sh", 'echo "building turbo"\necho "fatal: no compiler" >&2\nexit 7\n')
    _hook(d / "02_never.sh", f"touch {tmp_path}/ran\n")
    calls, _ = hooks.discover(d, None, ("--script", "a.py"), [])
    with pytest.raises(LaunchError) as err:
        execute.run_hooks(calls, {"PATH": "/usr/bin:/bin"}, timeout_s=30, python=sys.executable)
    msg = err.value.format_message()
    assert "hook 01_bad.sh exited with code 7" in msg
    assert "fatal: no compiler" in msg and "building turbo" in msg
    assert not (tmp_path / "ran").exists()


def test_run_hooks_timeout_stops_a_silent_hook(tmp_path: Path) -> None:
    calls, _ = hooks.discover(_hook(tmp_path / "h" / "00_slow.sh", "sleep 30\n").parent, None, (), [])
    with pytest.raises(LaunchError, match="timed out after 1 s"):
        execute.run_hooks(calls, {"PATH": "/usr/bin:/bin"}, timeout_s=1, python=sys.executable)


def test_dry_run_ok_marker_is_detected(tmp_path: Path) -> None:
    _hook(tmp_path / "00_x.sh", "#!/bin/bash\n# primus-hook: dry-run-ok\n")
    _hook(tmp_path / "01_y.sh", "#!/bin/bash\n")
    calls, _ = hooks.discover(tmp_path, None, (), [])
    assert [c.dry_run_ok for c in calls] == [True, False]
