"""Pure helpers of hooks/lib/primus_turbo_rebuild.py: redaction, arch lists, PYTHONPATH, cache keys."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

from tests.hooks.rebuild_hook_helpers import REPO_ROOT


def _lib(name: str) -> ModuleType:
    """A module of hooks/lib, imported as the hook's own interpreter does (that dir on sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO_ROOT / "hooks" / "lib"))
        return importlib.import_module(name)


common, settings, rebuild = _lib("turbo_common"), _lib("turbo_settings"), _lib("primus_turbo_rebuild")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://user:tok@github.com/AMD-AGI/x.git", "https://***@github.com/AMD-AGI/x.git"),
        (
            "fatal: unable to access 'https://tok@h/x/': 403",
            "fatal: unable to access 'https://***@h/x/': 403",
        ),
        ("ssh://git@host:22/x.git and https://a:b@c/d", "ssh://***@host:22/x.git and https://***@c/d"),
        ("git@github.com:AMD-AGI/x.git", "git@github.com:AMD-AGI/x.git"),  # scp form: no secret in it
        ("https://github.com/AMD-AGI/x.git", "https://github.com/AMD-AGI/x.git"),
    ],
)
def test_redact_hides_url_userinfo(text: str, expected: str) -> None:
    assert common.redact(text) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("gfx950", ("gfx950",)), ("gfx950;gfx942", ("gfx942", "gfx950")), (" gfx942 ; gfx942;", ("gfx942",))],
)
def test_parse_archs_sorts_and_dedupes(raw: str, expected: tuple[str, ...]) -> None:
    assert settings.parse_archs(raw) == expected


@pytest.mark.parametrize("raw", ["", ";", "sm_90", "gfx950,gfx942", "GFX950"])
def test_parse_archs_rejects_what_is_not_an_amd_arch_list(raw: str) -> None:
    with pytest.raises(common.HookError, match=r"^GPU_ARCHS=.*Use e\.g\. GPU_ARCHS=") as err:
        settings.parse_archs(raw)
    assert err.value.code == 2


def test_clean_pythonpath_drops_only_older_builds_of_this_dir() -> None:
    value = "/b/installs/abc:/opt/x::/b2/installs/y:/b/installs/def/sub"
    assert rebuild.clean_pythonpath(value, "/b") == ["/opt/x", "/b2/installs/y"]


def test_install_name_changes_with_every_key_field() -> None:
    key = rebuild.build_key("a" * 40, ("gfx950",))
    assert set(key) == {"commit", "gpu_archs", "python", "soabi", "torch"}
    names = {rebuild.install_name(key)} | {rebuild.install_name({**key, field: "other"}) for field in key}
    assert len(names) == len(key) + 1
    assert rebuild.install_name(key).startswith("a" * 12 + "-")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/usr/bin/python3", "-m", "pip", "--no-input", "wheel", "--no-deps", "."], "pip wheel"),
        (["git", "fetch", "--quiet", "origin"], "git fetch"),
        (["/usr/bin/python3", "-c", "import primus_turbo", "/x"], "the import check of the new build"),
    ],
)
def test_step_name_says_which_step_failed(argv: list[str], expected: str) -> None:
    assert common.step_name(argv) == expected
