"""The rebuild hook against real git and pip: a file:// upstream shaped like Primus-Turbo.

Each test gets its own build dir; the fake upstream is made once per session (see conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.hooks.rebuild_hook_helpers import (
    HOOK,
    REPO_ROOT,
    FakeTurbo,
    HookRun,
    builds,
    import_built,
    run_hook,
)


def _build_dir(env: dict[str, str]) -> Path:
    return Path(env["PRIMUS_TURBO_BUILD_DIR"])


def test_rebuild_hook_does_nothing_when_off(hook_env: dict[str, str]) -> None:
    hook_env.pop("REBUILD_PRIMUS_TURBO")
    run = run_hook(hook_env)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
    assert not _build_dir(hook_env).exists()


def test_rebuild_hook_first_run_builds_and_installs(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    hook_env["PRIMUS_TURBO_REF"] = fake_turbo.minimum
    run = run_hook(hook_env)
    assert run.returncode == 0, run.stderr
    install_dir = run.exports["PRIMUS_TURBO_INSTALL_DIR"]
    assert run.exports["PYTHONPATH"] == install_dir
    assert run.exports["PRIMUS_TURBO_COMMIT"] == fake_turbo.minimum
    assert Path(run.exports["PRIMUS_TURBO_WHEEL"]).is_file()
    built = import_built(run.exports["PYTHONPATH"], tmp_path)
    assert built == {"commit": fake_turbo.minimum, "ck": "ck-v1", "archs": "gfx950", "file": built["file"]}
    assert built["file"].startswith(install_dir + os.sep)
    assert builds(hook_env) == [fake_turbo.minimum]
    log = (_build_dir(hook_env) / "build.log").read_text()
    assert "compiling kernels for gfx950" in log
    assert (_build_dir(hook_env) / "current").resolve() == Path(install_dir)
    assert stat.S_IMODE((_build_dir(hook_env) / "src").stat().st_mode) == 0o700  # its .git/config has the URL


def test_rebuild_hook_second_run_is_a_cache_hit_under_a_second(
    hook_env: dict[str, str], fake_turbo: FakeTurbo
) -> None:
    hook_env["PRIMUS_TURBO_REF"] = fake_turbo.minimum
    first = run_hook(hook_env)
    assert first.returncode == 0, first.stderr
    timings = []
    for _ in range(3):  # best of 3: the box is shared, one slow start is noise, not the hook
        start = time.monotonic()
        again = run_hook(hook_env)
        timings.append(time.monotonic() - start)
        assert again.returncode == 0, again.stderr
        assert "up to date" in again.stderr
        assert again.exports == first.exports
    assert min(timings) < 1.0, f"cache hits took {[round(t, 2) for t in timings]} s"
    assert builds(hook_env) == [fake_turbo.minimum]


@pytest.mark.parametrize(
    "ref",
    [
        "main",
        pytest.param("v0.2.0", marks=pytest.mark.slow),
        pytest.param("newer-sha", marks=pytest.mark.slow),
    ],
)
def test_rebuild_hook_newer_ref_rebuilds_with_synced_submodules(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path, ref: str
) -> None:
    hook_env["PRIMUS_TURBO_REF"] = fake_turbo.minimum
    assert run_hook(hook_env).returncode == 0
    hook_env["PRIMUS_TURBO_REF"] = fake_turbo.newer if ref == "newer-sha" else ref
    run = run_hook(hook_env)
    assert run.returncode == 0, run.stderr
    built = import_built(run.exports["PYTHONPATH"], tmp_path)
    assert (built["commit"], built["ck"]) == (fake_turbo.newer, "ck-v2")
    assert builds(hook_env) == [fake_turbo.minimum, fake_turbo.newer]


def test_rebuild_hook_new_gpu_archs_rebuild(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    assert run_hook(hook_env).returncode == 0  # default ref: the minimum commit, for gfx950
    hook_env["GPU_ARCHS"] = "gfx950;gfx942"
    run = run_hook(hook_env)
    assert run.returncode == 0, run.stderr
    assert import_built(run.exports["PYTHONPATH"], tmp_path)["archs"] == "gfx942;gfx950"
    hook_env["GPU_ARCHS"] = "gfx942; gfx950"  # same set, other spelling: a cache hit
    assert "up to date" in run_hook(hook_env).stderr
    assert builds(hook_env) == [fake_turbo.minimum, fake_turbo.minimum]


def test_rebuild_hook_shows_progress_during_a_long_build(hook_env: dict[str, str]) -> None:
    hook_env.update(FAKE_TURBO_BUILD_SLEEP="2", PRIMUS_TURBO_PROGRESS_S="0.5")
    run = run_hook(hook_env)
    assert run.returncode == 0, run.stderr
    beats = [
        line
        for line in run.stderr.splitlines()
        if line.startswith("[primus-turbo] building ") and "s: " in line
    ]
    assert len(beats) >= 2, run.stderr
    assert any("compiling kernels for gfx950" in line for line in beats)  # the log's latest line


def test_rebuild_hook_refuses_ref_without_the_minimum_commit(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    hook_env["PRIMUS_TURBO_REF"] = fake_turbo.old
    run = run_hook(hook_env)
    assert run.returncode == 2
    assert f"PRIMUS_TURBO_REF={fake_turbo.old}" in run.stderr
    assert "does not contain the minimum commit" in run.stderr
    assert "PRIMUS_TURBO_ALLOW_OLD=1" in run.stderr
    assert run.stdout == "" and builds(hook_env) == []

    hook_env["PRIMUS_TURBO_ALLOW_OLD"] = "1"
    run = run_hook(hook_env)
    assert run.returncode == 0, run.stderr
    assert import_built(run.exports["PYTHONPATH"], tmp_path)["commit"] == fake_turbo.old


def test_rebuild_hook_concurrent_runs_build_once(hook_env: dict[str, str], fake_turbo: FakeTurbo) -> None:
    hook_env["FAKE_TURBO_BUILD_SLEEP"] = "1.5"  # both start while the first one builds
    procs = [
        subprocess.Popen(
            ["bash", str(HOOK)], env=hook_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    runs = [HookRun(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    assert runs[0].exports == runs[1].exports
    assert builds(hook_env) == [fake_turbo.minimum]
    assert any("waiting for the build already running" in r.stderr for r in runs)
    assert sum("up to date" in r.stderr for r in runs) == 1


def test_rebuild_hook_concurrent_runs_of_two_refs_each_get_their_own_build(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    hook_env["FAKE_TURBO_BUILD_SLEEP"] = "1"
    refs = [fake_turbo.minimum, fake_turbo.newer]
    procs = [
        subprocess.Popen(
            ["bash", str(HOOK)],
            env={**hook_env, "PRIMUS_TURBO_REF": ref},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for ref in refs
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    runs = [HookRun(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    for ref, run in zip(refs, runs, strict=True):  # the second build did not replace the first one's files
        assert import_built(run.exports["PYTHONPATH"], tmp_path)["commit"] == ref
    assert sorted(builds(hook_env)) == sorted(refs)


def test_rebuild_hook_broken_build_keeps_previous_install(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    good = run_hook(hook_env)
    assert good.returncode == 0, good.stderr
    hook_env["PRIMUS_TURBO_REF"] = "broken"
    run = run_hook(hook_env)
    assert run.returncode == 1
    assert run.stdout == ""
    assert "pip wheel failed" in run.stderr
    assert "fake compile error: undefined symbol turbo_grouped_gemm" in run.stderr  # the log's tail
    assert "fake compile error" in (_build_dir(hook_env) / "build.log").read_text()
    assert import_built(good.exports["PYTHONPATH"], tmp_path)["commit"] == fake_turbo.minimum
    current = _build_dir(hook_env) / "current"
    assert current.resolve() == Path(good.exports["PRIMUS_TURBO_INSTALL_DIR"])


def test_rebuild_hook_build_that_does_not_import_is_never_used(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    good = run_hook(hook_env)
    assert good.returncode == 0, good.stderr
    hook_env["PRIMUS_TURBO_REF"] = "bad-import"
    run = run_hook(hook_env)
    assert run.returncode == 1
    assert "the import check of the new build failed" in run.stderr
    assert "undefined symbol: hipModuleLaunchKernel" in run.stderr
    installs = _build_dir(hook_env) / "installs"
    assert [p.name for p in installs.iterdir()] == [Path(good.exports["PRIMUS_TURBO_INSTALL_DIR"]).name]
    assert import_built(good.exports["PYTHONPATH"], tmp_path)["commit"] == fake_turbo.minimum


def test_rebuild_hook_interrupted_build_keeps_previous_install(
    hook_env: dict[str, str], fake_turbo: FakeTurbo, tmp_path: Path
) -> None:
    good = run_hook(hook_env)
    assert good.returncode == 0, good.stderr
    hook_env.update(PRIMUS_TURBO_REF="main", FAKE_TURBO_BUILD_SLEEP="60")
    proc = subprocess.Popen(
        ["bash", str(HOOK)], env=hook_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while len(builds(hook_env)) < 2 and time.monotonic() < deadline:  # the compile step has started
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stdout == "" and "interrupted" in stderr
    installs = _build_dir(hook_env) / "installs"
    assert [p.name for p in installs.iterdir()] == [Path(good.exports["PRIMUS_TURBO_INSTALL_DIR"]).name]
    assert import_built(good.exports["PYTHONPATH"], tmp_path)["commit"] == fake_turbo.minimum
    hook_env["FAKE_TURBO_BUILD_SLEEP"] = "0"
    retry = run_hook(hook_env)  # the lock died with the interrupted run
    assert retry.returncode == 0, retry.stderr
    assert retry.exports["PRIMUS_TURBO_COMMIT"] == fake_turbo.newer


@pytest.mark.parametrize("how", ["--dry-run", "PRIMUS_DRY_RUN=1"])
def test_rebuild_hook_dry_run_changes_nothing(hook_env: dict[str, str], how: str) -> None:
    args = [how] if how.startswith("--") else []
    if not args:
        hook_env["PRIMUS_DRY_RUN"] = "1"
    run = run_hook(hook_env, *args)
    assert (run.returncode, run.stdout) == (0, "")
    assert "would clone" in run.stderr
    assert not _build_dir(hook_env).exists()


def test_rebuild_hook_dry_run_after_a_build_reports_the_cache(
    hook_env: dict[str, str], fake_turbo: FakeTurbo
) -> None:
    assert run_hook(hook_env).returncode == 0
    before = sorted(p.name for p in _build_dir(hook_env).rglob("*"))
    run = run_hook(hook_env, "--dry-run")
    assert (run.returncode, run.stdout) == (0, "")
    assert f"{fake_turbo.minimum[:12]} in the local clone" in run.stderr
    assert "already built; would reuse" in run.stderr
    assert sorted(p.name for p in _build_dir(hook_env).rglob("*")) == before


def test_rebuild_hook_never_shows_url_credentials(hook_env: dict[str, str]) -> None:
    # Nothing listens on the discard port of the loopback address: the clone fails at once.
    hook_env["PRIMUS_TURBO_REPO_URL"] = "https://alice:s3cr3t-t0ken@127.0.0.1:9/AMD-AGI/Primus-Turbo.git"
    run = run_hook(hook_env)
    assert run.returncode == 1
    assert "https://***@127.0.0.1:9/AMD-AGI/Primus-Turbo.git" in run.stderr
    logs = "".join(p.read_text() for p in (_build_dir(hook_env) / "logs").iterdir())
    assert "s3cr3t" not in run.stderr + run.stdout + logs
    assert "alice" not in run.stderr + logs


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("REBUILD_PRIMUS_TURBO", "yes", "expected 0 or 1"),
        ("GPU_ARCHS", "sm_90", "not a ;-separated list of AMD GPU architectures"),
        ("PRIMUS_TURBO_REF", "--upload-pack=touch", "must not start with '-'"),
        ("PRIMUS_TURBO_REF", "no-such-branch", "no branch, tag or commit of that name"),
        ("PRIMUS_TURBO_ALLOW_OLD", "true", "expected 0 or 1"),
        ("PRIMUS_TURBO_LOCK_TIMEOUT", "soon", "expected a number >= 0"),
    ],
)
def test_rebuild_hook_bad_setting_names_the_setting(
    hook_env: dict[str, str], name: str, value: str, problem: str
) -> None:
    hook_env[name] = value
    run = run_hook(hook_env)
    assert run.returncode == 2, run.stderr
    assert f"error: {name}={value}: {problem}" in run.stderr
    assert run.stdout == ""


def test_rebuild_hook_without_git_says_what_to_install(hook_env: dict[str, str], tmp_path: Path) -> None:
    hook_env["PATH"] = str(tmp_path / "empty")  # the interpreter is PRIMUS_TURBO_PYTHON, an absolute path
    done = subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(HOOK)], env=hook_env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "error: git is not installed here" in done.stderr
    assert "unset REBUILD_PRIMUS_TURBO" in done.stderr
    assert not _build_dir(hook_env).exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_rebuild_hook_help_needs_no_settings(flag: str) -> None:
    bash = shutil.which("bash") or "/bin/bash"  # and no PATH: help needs nothing else
    done = subprocess.run(
        [bash, str(HOOK), flag], capture_output=True, text=True, env={"PATH": "/nonexistent"}
    )
    assert done.returncode == 0
    assert done.stdout.startswith("Build Primus-Turbo at PRIMUS_TURBO_REF into a node-local dir")
    assert "docs/images.md" in done.stdout and "primus-hook:" not in done.stdout


def test_rebuild_hook_runs_from_any_directory(hook_env: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(HOOK.relative_to(REPO_ROOT)), "--dry-run"],
        env=hook_env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [str(HOOK), "--dry-run"], env=hook_env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
