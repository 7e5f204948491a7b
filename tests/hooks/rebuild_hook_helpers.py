"""Helpers for the rebuild-hook tests: the fake Primus-Turbo repository and a hook runner.

History of the fake upstream (``main``), oldest first:

* ``old``      — predates the MegaMoE op (the hook must refuse it);
* ``minimum``  — stands in for the real minimum commit (PRIMUS_TURBO_MIN_COMMIT points at it);
* ``newer``    — moves the ``third_party/ck`` submodule to its v2 commit; tagged ``v0.2.0``.

Branch ``broken`` (from ``newer``) fails to build; branch ``bad-import`` builds a package that does
not import. Everything is reached through ``file://`` URLs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HOOK = REPO_ROOT / "hooks" / "00_rebuild_primus_turbo.sh"
SETUP_PY = Path(__file__).with_name("fake_turbo_setup.py")

GIT_ENV = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.invalid",
    # Submodules over file:// are off by default since git 2.38.1; these repos are ours.
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "protocol.file.allow",
    "GIT_CONFIG_VALUE_0": "always",
}


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


@dataclasses.dataclass(frozen=True)
class FakeTurbo:
    """The fake upstream: its URL and the commits tests ask for by role."""

    url: str
    old: str
    minimum: str
    newer: str
    broken: str


def make_fake_turbo(root: Path) -> FakeTurbo:
    """Create the fake upstream (and its submodule) under `root`; see the module docstring."""
    ck = root / "ck"
    ck.mkdir(parents=True)
    _git(ck, "init", "-q", "-b", "main")
    (ck / "VERSION").write_text("ck-v1\n")
    ck_v1 = _commit(ck, "ck v1")
    (ck / "VERSION").write_text("ck-v2\n")
    _commit(ck, "ck v2")

    up = root / "Primus-Turbo"
    (up / "primus_turbo").mkdir(parents=True)
    _git(up, "init", "-q", "-b", "main")
    shutil.copy(SETUP_PY, up / "setup.py")
    (up / "primus_turbo" / "__init__.py").write_text(
        "from primus_turbo._build_info import CK_VERSION, COMMIT, GPU_ARCHS\n"
    )
    _git(up, "submodule", "add", "-q", ck.as_uri(), "third_party/ck")
    _git(up / "third_party" / "ck", "checkout", "-q", ck_v1)
    old = _commit(up, "old: before MegaMoE")
    (up / "primus_turbo" / "mega_moe.py").write_text("MEGA_MOE = True\n")
    minimum = _commit(up, "minimum: MegaMoE op")
    _git(up / "third_party" / "ck", "checkout", "-q", "main")
    newer = _commit(up, "newer: bump ck to v2")
    _git(up, "tag", "v0.2.0")
    _git(up, "checkout", "-q", "-b", "broken")
    with (up / "setup.py").open("a") as f:
        f.write('\nraise SystemExit("fake compile error: undefined symbol turbo_grouped_gemm")\n')
    broken = _commit(up, "broken build")
    _git(up, "checkout", "-q", "-b", "bad-import", newer)
    with (up / "primus_turbo" / "__init__.py").open("a") as f:
        f.write('raise ImportError("libprimus_turbo_kernels.so: undefined symbol: hipModuleLaunchKernel")\n')
    _commit(up, "builds, but does not import")
    _git(up, "checkout", "-q", "main")
    return FakeTurbo(url=up.as_uri(), old=old, minimum=minimum, newer=newer, broken=broken)


@dataclasses.dataclass
class HookRun:
    """One finished run of the hook: exit code, stdout, stderr and the env.K=V it exported."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def exports(self) -> dict[str, str]:
        pairs = (
            line[len("env.") :].split("=", 1) for line in self.stdout.splitlines() if line.startswith("env.")
        )
        return dict(pairs)


def builds(env: dict[str, str]) -> list[str]:
    """The commits built so far, one per wheel build."""
    counter = Path(env["FAKE_TURBO_BUILD_COUNTER"])
    return counter.read_text().split() if counter.exists() else []


def run_hook(env: dict[str, str], *args: str, timeout: float = 120) -> HookRun:
    done = subprocess.run(
        ["bash", str(HOOK), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
    )
    return HookRun(done.returncode, done.stdout, done.stderr)


def import_built(pythonpath: str, tmp_path: Path) -> dict[str, str]:
    """Import primus_turbo in a fresh interpreter with `pythonpath`, as training would."""
    probe = "import primus_turbo as p; print(p.COMMIT, p.CK_VERSION, p.GPU_ARCHS, p.__file__)"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.split()
    return {"commit": out[0], "ck": out[1], "archs": out[2], "file": out[3]}
