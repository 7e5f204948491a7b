"""Hooks: scripts that prepare a node before the command (rebuild a package, export NCCL settings).

Discovery: `hooks/*.sh|*.py` sorted by file name, then `hooks/<group>/<name>/*.sh|*.py` (for
`train pretrain`: `hooks/train/pretrain/`). Each hook gets the command's argv as its arguments
and the launcher's environment plus what earlier hooks exported. Protocol on stdout:

    env.NAME=VALUE    export NAME=VALUE to later hooks and to the training
    extra.key=value   append `--key value` to the command
    anything else     shown as progress

A non-zero exit stops the launch, naming the hook, its exit code and the tail of its output. A
dry run runs no hook, except one that declares `# primus-hook: dry-run-ok` in its first 20 lines:
that one is called with `--dry-run` as its first argument and must only report what it would do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from runner.plan import DRY_RUN_OK_MARK, HookCall

logger = logging.getLogger(__name__)

SKIP_VAR = "PRIMUS_SKIP_HOOKS"
SUFFIXES = (".sh", ".py")


def _dry_run_ok(path: Path) -> bool:
    try:
        with path.open(errors="replace") as f:
            return any(DRY_RUN_OK_MARK in line for _, line in zip(range(20), f, strict=False))
    except OSError:
        return False


def _matches(path: Path, names: Iterable[str]) -> bool:
    return any(n in (path.name, path.stem) for n in names)


def discover(
    hooks_dir: Path, group: tuple[str, str] | None, argv: tuple[str, ...], skip: Iterable[str]
) -> tuple[tuple[HookCall, ...], tuple[str, ...]]:
    """(hooks to run in order, names skipped by --skip-hook / PRIMUS_SKIP_HOOKS / hooks.skip)."""
    skip = [s.strip() for s in skip if s.strip()]
    dirs = [hooks_dir] + ([hooks_dir / group[0] / group[1]] if group else [])
    calls: list[HookCall] = []
    skipped: list[str] = []
    for d in dirs:
        if not d.is_dir():
            continue
        for path in sorted(
            (p for p in d.iterdir() if p.is_file() and p.suffix in SUFFIXES), key=lambda p: p.name
        ):
            name = str(path.relative_to(hooks_dir))
            if "all" in skip or _matches(path, skip) or name in skip:
                skipped.append(name)
                continue
            calls.append(HookCall(name=name, path=str(path), argv=argv, dry_run_ok=_dry_run_ok(path)))
    return tuple(calls), tuple(skipped)


def interpreter(path: str, python: str) -> list[str]:
    """`.sh` runs with bash, `.py` with the launcher's Python."""
    return ["bash", path] if path.endswith(".sh") else [python, path]


@dataclass(kw_only=True)
class HookOutput:
    """What hooks asked for, accumulated in order (later hooks win on the same name)."""

    env: dict[str, str] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)

    def add_line(self, hook: str, line: str) -> None:
        """Apply one stdout line of `hook`; log progress lines (and names, never env values)."""
        if line.startswith("env.") and "=" in line:
            name, value = line[4:].split("=", 1)
            if not name.isidentifier():
                logger.warning("hook %s: ignored malformed export %r", hook, line.split("=", 1)[0])
                return
            self.env[name] = value
            logger.info("hook %s: exports %s", hook, name)
        elif line.startswith("extra.") and "=" in line:
            key, value = line[6:].split("=", 1)
            self.extra += [f"--{key}", value]
            logger.info("hook %s: adds --%s", hook, key)
        elif line.strip():
            logger.info("hook %s: %s", hook, line.rstrip())
