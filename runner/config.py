"""Launcher config: typed sections, a strict YAML loader, and layering with provenance.

Layers, lowest first: built-in defaults (``runner/defaults/launcher.yaml``) < ``~/.primus.yaml`` <
``./.primus.yaml`` < ``--config FILE`` < environment (``DOCKER_IMAGE``) < command line. Each layer
is merged key by key (lists replace, they do not append), so a user file that only sets
``slurm.partition`` keeps every other default. Unknown keys are errors that suggest the close match;
values are converted by the field's annotation. The loader never reads ``os.environ``: the CLI passes
the environment layer in.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from runner.errors import ConfigError

DEFAULTS_SOURCE = "default"


@dataclass(kw_only=True, slots=True)
class MainOpts:
    debug: bool
    """Verbose launcher logs (same as --debug)."""
    dry_run: bool
    """Print the plan and run nothing (same as --dry-run)."""


@dataclass(kw_only=True, slots=True)
class SlurmOpts:
    launcher: Literal["srun", "sbatch"]
    """Default launcher when `slurm` is given none."""
    entry: Literal["container", "direct"]
    """What runs on each node when the command after `--` names none."""
    nodes: int | None
    partition: str | None
    account: str | None
    qos: str | None
    time: str | None
    """Time limit; none is injected when null."""
    reservation: str | None
    exclusive: bool
    job_name: str
    extra_flags: list[str]
    """More srun/sbatch flags, written as on the command line (`--gres=gpu:8`)."""
    log_dir: str
    """Where sbatch scripts and per-node logs (`%x-%j-node%n.out`) go."""
    signal_seconds: int | None
    """sbatch: Slurm sends the batch script SIGUSR1 this many seconds before the time limit
    (`--signal=B:USR1@<s>`); the ranks then save and exit 75. null = ask for no warning signal."""
    requeue: bool
    """sbatch: submit with `--requeue`, and a job whose ranks saved and exited 75 requeues itself
    (it resumes from that checkpoint); false = the job ends with exit code 75."""


@dataclass(kw_only=True, slots=True)
class ContainerOpts:
    runtime: Literal["auto", "docker", "podman"]
    image: str
    gpu: Literal["auto", "amd", "nvidia", "none"]
    ipc: str
    network: str
    shm_size: str | None
    """Passed only when ipc is not `host` (the host's /dev/shm is shared then)."""
    ulimits: list[str]
    """`--ulimit` values (`type=soft:hard`); a runtime drops its own defaults when any is given."""
    privileged: bool
    cap_add: list[str]
    security_opt: list[str]
    devices: list[str]
    volumes: list[str]
    python: str | None
    """Interpreter inside the image that runs `runner.node`."""
    name_prefix: str


@dataclass(kw_only=True, slots=True)
class DirectOpts:
    gpus_per_node: int | None
    master_port: int | None
    """MASTER_PORT wins; null = a free port on one node, 1234 on several, 20000 + job id % 20000 in Slurm."""
    log_dir: str | None
    """null = `<run dir>/logs` for `train pretrain` (its experiment's run directory), else `logs`."""
    log_ranks: Literal["first_last", "all"]


@dataclass(kw_only=True, slots=True)
class HooksOpts:
    dir: str
    timeout_s: int
    skip: list[str]


@dataclass(kw_only=True, slots=True)
class EnvOpts:
    forward: list[str]
    """Variable names forwarded into containers (by name only)."""
    prefixes: list[str]
    """Every set variable whose name starts with one of these is forwarded too."""


@dataclass(kw_only=True, slots=True)
class LauncherConfig:
    main: MainOpts
    slurm: SlurmOpts
    container: ContainerOpts
    direct: DirectOpts
    hooks: HooksOpts
    env: EnvOpts

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
    """The effective config and, for each dotted key, the layer its value came from."""

    config: LauncherConfig
    sources: dict[str, str] = field(default_factory=dict)

    def show(self) -> str:
        """`config show`: one `key: value  # source` line per setting, in schema order."""
        flat = _flatten(self.config.to_dict())
        texts = {k: yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
                 for k, v in flat.items()}  # fmt: skip
        width = min(max(len(f"{k}: {t}") for k, t in texts.items()), 56)
        lines = [
            f"{f'{key}: {text}'.ljust(width)}  # {self.sources.get(key, DEFAULTS_SOURCE)}"
            for key, text in texts.items()
        ]
        return "\n".join(lines)


def _section_types() -> dict[str, type]:
    """Section name -> its dataclass, in schema order."""
    hints = typing.get_type_hints(LauncherConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(LauncherConfig)}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else f" Known keys: {', '.join(sorted(known))}."
    return ConfigError(f"{where}: unknown launcher config key '{key}'.{hint}")


def _convert(key: str, value: Any, annotation: Any, where: str) -> Any:
    """Convert one YAML/CLI value by its field annotation; raise naming the key otherwise."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(key, value, inner[0], where)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(map(str, args))
            raise ConfigError(f"{where}: {key}={value!r} is not one of: {choices}.")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or any(isinstance(v, (dict, list)) or v is None for v in value):
            raise ConfigError(f"{where}: {key} must be a list of strings, got {value!r}.")
        return [str(v) for v in value]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}.")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}.")
        try:
            number = int(value)
        except ValueError as e:
            raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}.") from e
        if number < 1:  # every count, port and timeout of the launcher
            raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}.")
        return number
    if annotation is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{where}: {key} must be a string, got {value!r}.")
        return str(value)
    raise AssertionError(f"unsupported annotation {annotation!r} for {key}")


def _check_layer(tree: Any, where: str) -> dict[str, dict[str, Any]]:
    """Validate one layer's keys and types; return it converted (sections -> key -> value)."""
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{where}: the launcher config must be a mapping of sections, got {type(tree).__name__}."
        )
    sections = _section_types()
    out: dict[str, dict[str, Any]] = {}
    for section, body in tree.items():
        if section not in sections:
            raise _unknown(str(section), list(sections), where)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: section '{section}' must be a mapping, got {body!r}.")
        hints = typing.get_type_hints(sections[section])
        for key, value in body.items():
            if key not in hints:
                raise _unknown(f"{section}.{key}", [f"{section}.{k}" for k in hints], where)
            out.setdefault(section, {})[key] = _convert(f"{section}.{key}", value, hints[key], where)
    return out


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror}). Check the path.") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e


def parse_overrides(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    """Dotted `section.key=value` pairs (CLI, environment) as a nested layer."""
    tree: dict[str, dict[str, Any]] = {}
    for dotted, value in pairs:
        section, _, key = dotted.partition(".")
        tree.setdefault(section, {})[key] = value
    return tree


def resolve(
    *,
    home: Path | None,
    cwd: Path,
    config_file: Path | None,
    env_layer: list[tuple[str, Any]],
    cli_layer: list[tuple[str, Any]],
) -> ResolvedConfig:
    """Merge every layer into one LauncherConfig, recording where each value came from."""
    defaults = yaml.safe_load(resources.files("runner").joinpath("defaults/launcher.yaml").read_text())
    layers: list[tuple[str, Any]] = [(DEFAULTS_SOURCE, defaults)]
    for path in (home / ".primus.yaml" if home else None, cwd / ".primus.yaml"):
        if path is not None and path.is_file():
            layers.append((str(path), _read_yaml(path)))
    if config_file is not None:
        layers.append((str(config_file), _read_yaml(config_file)))
    layers.append(("environment", parse_overrides(env_layer, "environment")))
    layers.append(("command line", parse_overrides(cli_layer, "command line")))

    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for where, tree in layers:
        for section, body in _check_layer(tree, where).items():
            for key, value in body.items():
                merged.setdefault(section, {})[key] = value
                sources[f"{section}.{key}"] = where
    sections = _section_types()
    built = {}
    for name, cls in sections.items():
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in merged.get(name, {})]
        if missing:
            raise AssertionError(f"defaults/launcher.yaml lacks {name}.{missing[0]}")
        built[name] = cls(**merged[name])
    return ResolvedConfig(config=LauncherConfig(**built), sources=sources)


def from_dict(tree: dict[str, Any]) -> LauncherConfig:
    """Rebuild a LauncherConfig serialised with `to_dict()` (the plan handed to each node)."""
    checked = _check_layer(tree, "serialised launch request")
    sections = _section_types()
    return LauncherConfig(**{name: cls(**checked[name]) for name, cls in sections.items()})
