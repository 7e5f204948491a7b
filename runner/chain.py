"""The chain grammar, parsed once: `[slurm ... --] [container ... --] [direct ...] [--] <command>`.

Every mode's options are read here into one `Request`; nothing downstream re-parses argv. The
request (config included, environment values excluded) is what the launcher hands to each node
as JSON, so a node never reloads config files that may not exist there.

    slurm [srun|sbatch] [slurm flags] -- [container|direct] [opts] [--] <cmd>
    container [container opts] [--] [direct opts] [--] <cmd>
    direct [direct opts] [--] <cmd>
    <cmd> = train <name> [args...]  |  --script FILE [args...]
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from runner import config as config_mod
from runner.command import Command, parse_command
from runner.config import LauncherConfig
from runner.errors import ConfigError

# Options every mode understands before its own options end.
COMMON_FLAGS = ("--dry-run", "--plan-json", "--debug")


@dataclass(frozen=True, kw_only=True)
class Request:
    """The whole parsed command line plus the resolved launcher config."""

    chain: tuple[str, ...]
    """Modes outermost first, always ending in "direct": ("slurm", "container", "direct")."""
    command: Command
    config: LauncherConfig
    launcher: Literal["srun", "sbatch"] | None = None
    slurm_flags: tuple[tuple[str, str | None], ...] = ()
    """Merged config + CLI slurm flags as (long name, value or None for a switch)."""
    env_names: tuple[str, ...] = ()
    """Names set with `--env NAME=VALUE`: the values live only in the launcher's environment."""
    volumes: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    ulimits: tuple[str, ...] = ()
    skip_hooks: tuple[str, ...] = ()
    clean: bool = False
    follow: bool = False
    cwd: str = ""
    """The checkout (the launcher's working directory): mounted at the same path, hooks live here."""
    run_dir: str | None = None
    """The training's run directory (`<workspace>/<work_group>/<user_name>/<exp_name>`), as the
    preflight reported it: the default home of the node logs."""

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["command"] = {"kind": self.command.kind, "argv": list(self.command.argv)}
        out["config"] = self.config.to_dict()
        out["slurm_flags"] = [list(p) for p in self.slurm_flags]
        for key in ("chain", "env_names", "volumes", "devices", "ulimits", "skip_hooks"):
            out[key] = list(out[key])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Request:
        return cls(
            chain=tuple(data["chain"]),
            command=Command(kind=data["command"]["kind"], argv=tuple(data["command"]["argv"])),
            config=config_mod.from_dict(data["config"]),
            launcher=data["launcher"],
            slurm_flags=tuple((k, v) for k, v in data["slurm_flags"]),
            env_names=tuple(data["env_names"]),
            volumes=tuple(data["volumes"]),
            devices=tuple(data["devices"]),
            ulimits=tuple(data["ulimits"]),
            skip_hooks=tuple(data["skip_hooks"]),
            clean=data["clean"],
            follow=data["follow"],
            cwd=data["cwd"],
            run_dir=data["run_dir"],
        )

    def inner(self) -> Request:
        """The request one level down the chain (what a node runs after srun, or a container)."""
        return dataclasses.replace(self, chain=self.chain[1:])


@dataclass(kw_only=True)
class Parsed:
    """What the command line says, before the config layers are merged."""

    chain: list[str] = field(default_factory=list)
    launcher: str | None = None
    slurm_cli_flags: list[tuple[str, str | None]] = field(default_factory=list)
    cli_layer: list[tuple[str, Any]] = field(default_factory=list)
    env_values: dict[str, str] = field(default_factory=dict)
    volumes: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    ulimits: list[str] = field(default_factory=list)
    skip_hooks: list[str] = field(default_factory=list)
    clean: bool = False
    follow: bool = False
    dry_run: bool = False
    plan_json: bool = False
    debug: bool = False
    help_for: str | None = None
    config_file: str | None = None
    command: Command | None = None


# --------------------------------------------------------------------------- slurm flags

# srun/sbatch short options and the long names they stand for.
SLURM_SHORT = {
    "-N": "nodes", "-n": "ntasks", "-p": "partition", "-t": "time", "-J": "job-name",
    "-A": "account", "-q": "qos", "-w": "nodelist", "-x": "exclude", "-c": "cpus-per-task",
    "-o": "output", "-e": "error", "-G": "gpus", "-C": "constraint", "-d": "dependency",
    "-D": "chdir", "-a": "array", "-m": "distribution", "-s": "oversubscribe", "-l": "label",
    "-u": "unbuffered", "-v": "verbose", "-Q": "quiet", "-K": "kill-on-bad-exit", "-W": "wait",
}  # fmt: skip
# Flags that take no value (a following word is not theirs).
SLURM_SWITCHES = {
    "exclusive", "requeue", "no-requeue", "overcommit", "oversubscribe", "contiguous", "hold",
    "test-only", "verbose", "quiet", "label", "unbuffered", "kill-on-bad-exit", "wait", "parsable",
    "no-kill", "spread-job", "use-min-nodes", "mpi=none",
}  # fmt: skip
# Launcher config keys that are slurm flags, in the order they are written.
CONFIG_FLAGS = ("nodes", "partition", "account", "qos", "time", "reservation", "exclusive", "job_name")


# Flags whose value is a count: a positive integer (`[type:]N` for the GPU counts).
SLURM_COUNTS = {
    "nodes", "ntasks", "ntasks-per-node", "ntasks-per-socket", "ntasks-per-core", "ntasks-per-gpu",
    "cpus-per-task", "cpus-per-gpu", "sockets-per-node", "cores-per-socket", "threads-per-core",
}  # fmt: skip
SLURM_GPU_COUNTS = {"gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket"}
_COUNT = re.compile(r"[1-9][0-9]*")
_GPU_COUNT = re.compile(r"([A-Za-z0-9_.-]+:)?[1-9][0-9]*")


def _check_count(name: str, value: str | None, typed: str, where: str) -> None:
    """A count flag's value is a positive integer (`-N abc` would reach torchrun as `--nnodes abc`)."""
    pattern = _COUNT if name in SLURM_COUNTS else _GPU_COUNT if name in SLURM_GPU_COUNTS else None
    if pattern is None or (value is not None and pattern.fullmatch(value)):
        return
    example = "[type:]N, e.g. 8 or mi300x:8" if pattern is _GPU_COUNT else "e.g. 2"
    raise ConfigError(f"{where}: {typed}: --{name} must be a positive integer ({example}), got {value!r}.")


def parse_slurm_flags(tokens: list[str], where: str) -> list[tuple[str, str | None]]:
    """`-N 4`, `-N4`, `--nodes 4`, `--nodes=4` all become ("nodes", "4"); counts are checked."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        typed = tok
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
            if (
                not eq
                and name not in SLURM_SWITCHES
                and i + 1 < len(tokens)
                and not tokens[i + 1].startswith("-")
            ):
                value, eq = tokens[i + 1], "="
                typed = f"{tok} {value}"
                i += 1
            out.append((name, value if eq else None))
        elif tok.startswith("-") and len(tok) >= 2 and tok[:2] in SLURM_SHORT:
            name = SLURM_SHORT[tok[:2]]
            if len(tok) > 2:
                out.append((name, tok[2:].lstrip("=")))
            elif name in SLURM_SWITCHES:
                out.append((name, None))
            elif i + 1 < len(tokens):
                out.append((name, tokens[i + 1]))
                typed = f"{tok} {tokens[i + 1]}"
                i += 1
            else:
                raise ConfigError(f"{where}: slurm flag {tok} needs a value.")
        else:
            raise ConfigError(
                f"{where}: unexpected '{tok}' among the slurm flags. "
                "Separate the slurm flags from the command with '--': "
                "primus-cli slurm srun -N 2 -- container -- train pretrain --config X"
            )
        _check_count(*out[-1], typed, where)
        i += 1
    return out


def merge_slurm_flags(
    cfg: LauncherConfig, cli: list[tuple[str, str | None]], command: Command
) -> tuple[tuple[str, str | None], ...]:
    """Config flags first (schema order), then CLI flags; a CLI flag replaces the config's value.

    A command that runs once (`train prepare-data`) gets one node: `--nodes=1` unless given, and
    more than one is an error rather than N copies writing the same files.
    """
    merged: dict[str, str | None] = {}
    for key in CONFIG_FLAGS:
        value = getattr(cfg.slurm, key)
        if value is None or value is False:
            continue
        merged[key.replace("_", "-")] = None if value is True else str(value)
    for name, value in parse_slurm_flags(list(cfg.slurm.extra_flags), "slurm.extra_flags"):
        merged[name] = value
    for name, value in cli:
        merged[name] = value
    if "ntasks" in merged or merged.get("ntasks-per-node", "1") != "1":
        name = "ntasks" if "ntasks" in merged else "ntasks-per-node"
        raise ConfigError(
            f"slurm --{name}={merged[name]}: primus-cli starts one task per node and torchrun starts "
            "the per-GPU processes. Drop the flag; set GPUS_PER_NODE or direct.gpus_per_node instead."
        )
    merged.pop("ntasks-per-node", None)  # always added as --ntasks-per-node=1
    if not command.distributed and merged.setdefault("nodes", "1") != "1":
        raise ConfigError(
            f"slurm --nodes={merged['nodes']}: `{command.name}` runs as one process on one node. "
            "Use -N 1 (or leave -N out)."
        )
    return tuple(merged.items())


# --------------------------------------------------------------------------- mode options

# option -> (config key or special action, takes a value)
DIRECT_OPTS: dict[str, tuple[str, bool]] = {
    "--env": ("env", True),
    "--log-dir": ("direct.log_dir", True),
    "--gpus-per-node": ("direct.gpus_per_node", True),
    "--master-port": ("direct.master_port", True),
    "--log-ranks": ("direct.log_ranks", True),
    "--skip-hook": ("skip_hook", True),
    "--hook-timeout": ("hooks.timeout_s", True),
    "--hooks-dir": ("hooks.dir", True),
}
CONTAINER_OPTS: dict[str, tuple[str, bool]] = {
    "--image": ("container.image", True),
    "--runtime": ("container.runtime", True),
    "--gpu": ("container.gpu", True),
    "--ipc": ("container.ipc", True),
    "--network": ("container.network", True),
    "--shm-size": ("container.shm_size", True),
    "--ulimit": ("ulimit", True),
    "--name": ("container.name_prefix", True),
    "--python": ("container.python", True),
    "--privileged": ("container.privileged", False),
    "--cap-add": ("container.cap_add+", True),
    "--security-opt": ("container.security_opt+", True),
    "--volume": ("volume", True),
    "-v": ("volume", True),
    "--device": ("device", True),
    "--env": ("env", True),
    "-e": ("env", True),
    "--clean": ("clean", False),
}
SLURM_OWN = {"--follow": ("follow", False)}
COUNT_OPTIONS = ("--gpus-per-node", "--master-port", "--hook-timeout")
"""Mode options whose value is a positive integer."""


def _env_option(value: str, parsed: Parsed, where: str) -> None:
    """`--env NAME=VALUE` sets it for the launch; `--env NAME` forwards it from this environment."""
    name, eq, val = value.partition("=")
    if not name.isidentifier():
        raise ConfigError(f"{where}: --env {name!r}: expected NAME=VALUE or NAME (a variable name).")
    parsed.env_values[name] = val if eq else None  # type: ignore[assignment]


def _apply(action: str, value: Any, parsed: Parsed, where: str) -> None:
    if action == "env":
        _env_option(value, parsed, where)
    elif action == "skip_hook":
        parsed.skip_hooks.append(value)
    elif action == "volume":
        parsed.volumes.append(value)
    elif action == "device":
        parsed.devices.append(value)
    elif action == "ulimit":
        parsed.ulimits.append(value)
    elif action in ("clean", "follow"):
        setattr(parsed, action, True)
    else:
        parsed.cli_layer.append((action, value))


def _mode_options(
    tokens: list[str], opts: dict[str, tuple[str, bool]], mode: str, parsed: Parsed, stop_at_command: bool
) -> list[str]:
    """Consume `mode`'s options; return what follows its `--` (or starts at the command)."""
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            return tokens[i + 1 :]
        if stop_at_command and (tok == "--script" or not tok.startswith("-")):
            return tokens[i:]
        name, eq, inline = tok.partition("=")
        if name in ("-h", "--help"):
            parsed.help_for = mode
            return []
        if name in COMMON_FLAGS and not eq:
            setattr(parsed, name[2:].replace("-", "_"), True)
        elif name == "--config":
            value = inline if eq else _value(tokens, i, tok, mode)
            i += 0 if eq else 1
            parsed.config_file = value
        elif name in opts:
            action, takes = opts[name]
            if not takes:
                if action.startswith("container."):
                    parsed.cli_layer.append((action, True))
                else:
                    _apply(action, True, parsed, mode)
            else:
                value = inline if eq else _value(tokens, i, tok, mode)
                i += 0 if eq else 1
                if name in COUNT_OPTIONS and not _COUNT.fullmatch(value):
                    raise ConfigError(f"primus-cli {mode}: {name} {value}: expected a positive integer.")
                _apply(action, value, parsed, f"primus-cli {mode}")
        else:
            known = sorted({*opts, *COMMON_FLAGS, "--config", "--help"})
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]}?" if close else f" Options: {' '.join(known)}."
            raise ConfigError(
                f"primus-cli {mode}: unknown option {name}.{hint} (see primus-cli {mode} --help)"
            )
        i += 1
    return []


def _value(tokens: list[str], i: int, tok: str, mode: str) -> str:
    if i + 1 >= len(tokens):
        raise ConfigError(f"primus-cli {mode}: {tok} needs a value.")
    return tokens[i + 1]


def parse_chain(mode: str, tokens: list[str]) -> Parsed:
    """Parse everything after the mode name (`direct`, `container` or `slurm`)."""
    parsed = Parsed()
    rest = tokens
    if mode == "slurm":
        parsed.chain.append("slurm")
        rest = _parse_slurm(rest, parsed)
        if parsed.help_for:
            return parsed
        mode = "container"
        if rest and rest[0] in ("container", "direct"):
            mode, rest = rest[0], rest[1:]
        else:
            parsed.chain.append("<entry>")  # resolved from slurm.entry once the config is known
    if mode == "container":
        if parsed.chain[-1:] != ["<entry>"]:
            parsed.chain.append("container")
        rest = _mode_options(rest, CONTAINER_OPTS, "container", parsed, stop_at_command=True)
        if parsed.help_for:
            return parsed
    parsed.chain.append("direct")
    rest = _mode_options(rest, DIRECT_OPTS, "direct", parsed, stop_at_command=True)
    if parsed.help_for:
        return parsed
    parsed.command = parse_command(rest)
    return parsed


def _parse_slurm(tokens: list[str], parsed: Parsed) -> list[str]:
    i = 0
    flags: list[str] = []
    while i < len(tokens) and tokens[i] != "--":
        tok = tokens[i]
        if tok in ("-h", "--help"):
            parsed.help_for = "slurm"
            return []
        if tok in ("srun", "sbatch") and parsed.launcher is None and not flags:
            parsed.launcher = tok
        elif tok in COMMON_FLAGS:
            setattr(parsed, tok[2:].replace("-", "_"), True)
        elif tok in SLURM_OWN:
            parsed.follow = True
        elif tok == "--config" or tok.startswith("--config="):
            parsed.config_file = tok.split("=", 1)[1] if "=" in tok else _value(tokens, i, tok, "slurm")
            i += 0 if "=" in tok else 1
        else:
            flags.append(tok)
        i += 1
    if i >= len(tokens):
        raise ConfigError(
            "primus-cli slurm: missing '--' before the command. "
            "Write: primus-cli slurm srun -N 2 -- [container|direct] [opts] -- train pretrain --config X"
        )
    parsed.slurm_cli_flags = parse_slurm_flags(flags, "primus-cli slurm")
    return tokens[i + 1 :]


def make_request(parsed: Parsed, cfg: LauncherConfig, env: dict[str, str], *, cwd: str) -> Request:
    """Combine the parsed command line with the resolved config (entry and launcher defaults)."""
    assert parsed.command is not None
    modes = list(parsed.chain)
    if "<entry>" in modes:
        modes = [m for m in modes if m not in ("<entry>", "direct")] + [cfg.slurm.entry, "direct"]
    modes = list(dict.fromkeys(modes))
    on_slurm = modes[0] == "slurm"
    return Request(
        chain=tuple(modes),
        command=parsed.command,
        config=cfg,
        launcher=(parsed.launcher or cfg.slurm.launcher) if on_slurm else None,  # type: ignore[arg-type]
        slurm_flags=merge_slurm_flags(cfg, parsed.slurm_cli_flags, parsed.command) if on_slurm else (),
        env_names=tuple(n for n in parsed.env_values if n in env),
        volumes=tuple(parsed.volumes),
        devices=tuple(parsed.devices),
        ulimits=tuple(parsed.ulimits),
        skip_hooks=tuple(parsed.skip_hooks),
        clean=parsed.clean,
        follow=parsed.follow,
        cwd=cwd,
    )
