"""Fixtures of the rebuild-hook tests: the fake Primus-Turbo upstream and a hook environment."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.hooks.rebuild_hook_helpers import GIT_ENV, SETUP_PY, FakeTurbo, _commit, _git


@pytest.fixture(scope="session")
def fake_turbo(tmp_path_factory: pytest.TempPathFactory) -> FakeTurbo:
    root = tmp_path_factory.mktemp("fake_turbo")
    ck = root / "ck"
    ck.mkdir()
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


@pytest.fixture
def hook_env(fake_turbo: FakeTurbo, tmp_path: Path) -> dict[str, str]:
    """The environment of a rebuild into a fresh build dir under tmp_path, counting builds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIMUS_", "GPU_ARCHS", "REBUILD_"))}
    env.pop("PYTHONPATH", None)
    env.update(GIT_ENV)
    env.update(
        REBUILD_PRIMUS_TURBO="1",
        PRIMUS_TURBO_REPO_URL=fake_turbo.url,
        PRIMUS_TURBO_MIN_COMMIT=fake_turbo.minimum,
        PRIMUS_TURBO_BUILD_DIR=str(tmp_path / "build"),
        PRIMUS_TURBO_PYTHON=sys.executable,
        FAKE_TURBO_BUILD_COUNTER=str(tmp_path / "builds.txt"),
    )
    return env
