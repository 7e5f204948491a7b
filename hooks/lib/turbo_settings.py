"""The rebuild hook's settings: read once from the environment, each checked with a named error."""

from __future__ import annotations

import dataclasses
import os
import re
import socket

from turbo_common import setting_error

DEFAULT_REPO_URL = "https://github.com/AMD-AGI/Primus-Turbo.git"
# The oldest Primus-Turbo commit with the MegaMoE op this toolkit drives.
MIN_COMMIT = "9b5d3092efcbc087657b233d8e9ae662cee6ec6b"
DEFAULT_GPU_ARCHS = "gfx950"
_ARCH_RE = re.compile(r"^gfx[0-9a-z]+$")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The hook's inputs, read once from the environment."""

    repo_url: str
    ref: str
    min_commit: str
    allow_old: bool
    gpu_archs: tuple
    build_dir: str
    lock_timeout_s: float
    keep: int
    install_requirements: bool
    import_check: bool
    progress_s: float
    dry_run: bool

    @property
    def src(self) -> str:
        return os.path.join(self.build_dir, "src")

    @property
    def installs(self) -> str:
        return os.path.join(self.build_dir, "installs")


def flag(env: dict, name: str) -> bool:
    value = env.get(name, "")
    if value not in ("", "0", "1"):
        raise setting_error(
            name, value, "expected 0 or 1", f"Set {name}=1 to turn it on, unset it to turn it off"
        )
    return value == "1"


def _number(env: dict, name: str, default: float, minimum: float) -> float:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise setting_error(name, raw, f"expected a number >= {minimum:g}", f"Unset {name} for {default:g}")
    return value


def parse_archs(raw: str) -> tuple:
    """``"gfx950; gfx942;gfx950"`` -> ``("gfx942", "gfx950")``: sorted and unique, so order never rebuilds."""
    archs = sorted({a.strip() for a in raw.split(";") if a.strip()})
    bad = [a for a in archs if not _ARCH_RE.match(a)]
    if not archs or bad:
        raise setting_error(
            "GPU_ARCHS",
            raw,
            f"not a ;-separated list of AMD GPU architectures (bad: {', '.join(bad) or 'empty'})",
            'Use e.g. GPU_ARCHS="gfx950" or GPU_ARCHS="gfx942;gfx950"',
        )
    return tuple(archs)


def read_settings(env: dict, dry_run: bool) -> Settings:
    """Settings from the environment, each checked with a message that names it."""
    host = env.get("HOSTNAME") or socket.gethostname()
    repo_url = env.get("PRIMUS_TURBO_REPO_URL") or DEFAULT_REPO_URL
    min_commit = env.get("PRIMUS_TURBO_MIN_COMMIT") or MIN_COMMIT
    ref = env.get("PRIMUS_TURBO_REF") or min_commit
    for name, value in (("PRIMUS_TURBO_REPO_URL", repo_url), ("PRIMUS_TURBO_REF", ref)):
        if value.startswith("-") or any(c.isspace() for c in value):
            raise setting_error(name, value, "must not start with '-' or contain spaces", "Check the value")
    if not re.match(r"^[0-9a-f]{7,40}$", min_commit):
        raise setting_error("PRIMUS_TURBO_MIN_COMMIT", min_commit, "not a commit sha", "Unset it")
    build_dir = os.path.abspath(env.get("PRIMUS_TURBO_BUILD_DIR") or f"/tmp/primus_turbo_{host}")
    return Settings(
        repo_url=repo_url,
        ref=ref,
        min_commit=min_commit,
        allow_old=flag(env, "PRIMUS_TURBO_ALLOW_OLD"),
        gpu_archs=parse_archs(env.get("GPU_ARCHS") or DEFAULT_GPU_ARCHS),
        build_dir=build_dir,
        lock_timeout_s=_number(env, "PRIMUS_TURBO_LOCK_TIMEOUT", 3000.0, 0.0),
        keep=int(_number(env, "PRIMUS_TURBO_KEEP", 3, 1)),
        install_requirements=flag(env, "PRIMUS_TURBO_INSTALL_REQUIREMENTS"),
        import_check=flag(env, "PRIMUS_TURBO_IMPORT_CHECK") or not env.get("PRIMUS_TURBO_IMPORT_CHECK"),
        progress_s=_number(env, "PRIMUS_TURBO_PROGRESS_S", 30.0, 0.1),
        dry_run=dry_run,
    )
