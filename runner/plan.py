"""The launch plan: a frozen, serialisable tree that `--dry-run` prints and `execute` runs.

A plan lists the trainer's config check that runs first (the preflight), its steps outermost first
(sbatch or srun, then the container, then torchrun, or a plain python for a command that runs
once), the hooks that run before the command, the names of forwarded variables (never their
values) and warnings. `str(plan)` is the dry-run text, `to_dict()` the `--plan-json` payload.
Values that are only known on each node (its rank, the job id) appear as `<NAME>` placeholders.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Literal

StepKind = Literal["sbatch", "srun", "container", "torchrun", "python"]
COMMAND_STEPS = ("torchrun", "python")
"""The step kinds that run the command itself (the hooks run just before them)."""

DRY_RUN_OK_MARK = "primus-hook: dry-run-ok"


@dataclass(frozen=True, kw_only=True)
class Step:
    """One process of the chain: its argv and the variables it receives by name."""

    kind: StepKind
    argv: tuple[str, ...]
    where: str
    """Where it runs: `here` or `on each node` (or `inside the container on each node`)."""
    env_names: tuple[str, ...] = ()
    """Variables this step passes on by name (container `-e NAME`, srun's exported environment)."""
    script: str | None = None
    """The batch script an sbatch step submits (rendered text)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "argv": list(self.argv), "where": self.where}
        out["env_names"] = list(self.env_names)
        if self.script is not None:
            out["script"] = self.script
        return out


@dataclass(frozen=True, kw_only=True)
class HookCall:
    """A hook that runs before the command, with the command's argv as its arguments."""

    name: str
    path: str
    argv: tuple[str, ...]
    dry_run_ok: bool = False
    """The hook declares `# primus-hook: dry-run-ok`: a dry run may call it with `--dry-run` first."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "argv": list(self.argv), "dry_run_ok": self.dry_run_ok}


@dataclass(frozen=True, kw_only=True)
class Preflight:
    """`python -m megamoe.train check`: the trainer's config checked once, here, before any hook."""

    argv: tuple[str, ...]
    world_size: int
    basis: str
    """How the world size is made up: `2 nodes x 8 processes`."""
    assumed: str = ""
    """What was assumed or guessed because this host cannot know it (said with a failure too)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "argv": list(self.argv),
            "world_size": self.world_size,
            "basis": self.basis,
            "assumed": self.assumed,
        }

    def describe(self) -> str:
        assumed = f"; assumed: {self.assumed}" if self.assumed else ""
        return f"world size {self.world_size} = {self.basis}{assumed}"


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Everything a launch would do, in order; executing it never changes it."""

    chain: tuple[str, ...]
    steps: tuple[Step, ...]
    hooks: tuple[HookCall, ...] = ()
    hooks_where: str = "here"
    env_names: tuple[str, ...] = ()
    """Every variable forwarded by name along the chain (names only)."""
    warnings: tuple[str, ...] = ()
    log_file: str | None = None
    skipped_hooks: tuple[str, ...] = field(default=())
    preflight: Preflight | None = None

    def wrapped_by(self, outer: Step, warnings: tuple[str, ...] = ()) -> LaunchPlan:
        """This plan with ``outer`` run first (a mode wrapping the chain built so far)."""
        return replace(
            self,
            steps=(outer, *self.steps),
            env_names=tuple(dict.fromkeys((*outer.env_names, *self.env_names))),
            warnings=tuple(dict.fromkeys((*self.warnings, *warnings))),
        )

    def step(self, kind: StepKind) -> Step | None:
        return next((s for s in self.steps if s.kind == kind), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chain": list(self.chain),
            "steps": [s.to_dict() for s in self.steps],
            "hooks": [h.to_dict() for h in self.hooks],
            "hooks_where": self.hooks_where,
            "skipped_hooks": list(self.skipped_hooks),
            "env_names": list(self.env_names),
            "warnings": list(self.warnings),
            "log_file": self.log_file,
            "preflight": self.preflight.to_dict() if self.preflight else None,
        }

    def __str__(self) -> str:
        ran = "only the preflight ran" if self.preflight else "nothing was run"
        lines = [f"# primus-cli plan: {' -> '.join(self.chain)} (dry run: {ran})"]
        if self.preflight:
            lines.append(f"# preflight (here, before any hook): {self.preflight.describe()}")
            lines.append(shlex.join(self.preflight.argv))
        for i, step in enumerate(self.steps, 1):
            if step.kind in COMMAND_STEPS and (self.hooks or self.skipped_hooks):
                lines.append(f"# hooks ({self.hooks_where}, before the command):")
                lines += [
                    f"#   {h.name}{'  [dry-run-ok]' if h.dry_run_ok else ''}  ({h.path})" for h in self.hooks
                ]
                lines += [f"#   {name}  [skipped]" for name in self.skipped_hooks]
            lines.append(f"# [{i}] {step.kind} ({step.where})")
            if step.env_names:
                lines.append(f"#     env by name: {' '.join(step.env_names)}")
            lines.append(shlex.join(step.argv))
            if step.script is not None:
                lines.append("# --- batch script ---")
                lines.append(step.script.rstrip("\n"))
                lines.append("# --- end of batch script ---")
        if self.log_file:
            lines.append(f"# node log: {self.log_file}")
        lines.append(f"# env forwarded (names only): {' '.join(self.env_names) or '(none)'}")
        lines += [f"# WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)
