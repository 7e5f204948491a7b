"""Fixtures of the rebuild-hook tests: the fake Primus-Turbo upstream and a hook environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.hooks.rebuild_hook_helpers import GIT_ENV, FakeTurbo, make_fake_turbo


@pytest.fixture(scope="session")
def fake_turbo(tmp_path_factory: pytest.TempPathFactory) -> FakeTurbo:
    return make_fake_turbo(tmp_path_factory.mktemp("fake_turbo"))


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
