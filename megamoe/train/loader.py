"""Primus experiment YAMLs: ``extends`` chains, ``${VAR}`` / ``${VAR:default}``, packaged presets.

An experiment file holds ``work_group``, ``user_name``, ``exp_name``, ``workspace`` and
``modules.pre_trainer: {framework: megatron, config: <trainer preset>, model: <model preset>,
overrides: {...}}``. Presets are flat ``key: value`` files found next to the experiment first, then
in the package (``megamoe/configs/{modules,models}/megatron/``). Merge order, as in Primus: model
preset, then trainer preset (the trainer wins on a key both set), then ``overrides``, then the CLI.

The environment is passed in (``environ``), never read here, so tests and dry runs are pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from megamoe.errors import InvalidConfigError, UnsupportedSettingError

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")
_EXPERIMENT_KEYS = ("work_group", "user_name", "exp_name", "workspace", "modules")
_MODULE_KEYS = ("framework", "config", "model", "overrides")


@dataclass(kw_only=True, slots=True)
class Experiment:
    """A resolved experiment: identity keys, flat params, and which file set each param."""

    path: Path
    identity: dict[str, Any]
    params: dict[str, Any]
    source: dict[str, str] = field(default_factory=dict)
    """param -> the file (or ``cli``) that set its value last."""


def packaged_presets_dir(kind: str) -> Path:
    """Folder of the packaged presets: ``kind`` is ``modules`` (trainer) or ``models``."""
    return Path(str(resources.files("megamoe") / "configs" / kind / "megatron"))


def load_yaml(path: Path, environ: Mapping[str, str], _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One YAML file with ``${VAR}`` substituted and its ``extends`` merged underneath it."""
    path = path.resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise InvalidConfigError("extends", str(path), f"cycle: {cycle}", "Remove one of the extends")
    if not path.is_file():
        raise InvalidConfigError("config", str(path), "no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise InvalidConfigError("config", str(path), f"not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise InvalidConfigError("config", str(path), "the top level must be a mapping of key: value")
    data = substitute(data, environ, where=str(path))
    parents = data.pop("extends", None) or []
    merged: dict[str, Any] = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        merged = deep_merge(merged, load_yaml(path.parent / parent, environ, (*_chain, path)))
    return deep_merge(merged, data)


def substitute(value: Any, environ: Mapping[str, str], *, where: str) -> Any:
    """``${VAR}`` (required) and ``${VAR:default}`` in every string; a whole-string one is typed."""
    if isinstance(value, dict):
        return {k: substitute(v, environ, where=where) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, environ, where=where) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value

    def lookup(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is None:
            raise InvalidConfigError(
                f"${{{name}}}",
                None,
                f"required environment variable is not set (in {where})",
                f"export {name}=... or write ${{{name}:default}} in the file",
            )
        return default

    whole = _VAR.fullmatch(value.strip())
    text = _VAR.sub(lookup, value)
    if whole:
        typed = yaml.safe_load(text) if text.strip() else None
        return typed if isinstance(typed, (bool, int, float, type(None))) else text
    return text


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``; nested mappings merge, everything else is replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _find_preset(name: str, kind: str, experiment_dir: Path) -> Path:
    local = experiment_dir / name
    if local.is_file():
        return local
    packaged = packaged_presets_dir(kind) / name
    if packaged.is_file():
        return packaged
    available = sorted(p.name for p in packaged_presets_dir(kind).glob("*.yaml"))
    setting = "config" if kind == "modules" else "model"
    raise InvalidConfigError(
        f"modules.pre_trainer.{setting}",
        name,
        "no preset of that name next to the experiment or in the package",
        f"Use one of: {', '.join(available)}",
    )


def _check_keys(mapping: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    from megamoe.train.convert import unknown_key_error

    for key, value in mapping.items():
        if key not in allowed:
            error = unknown_key_error(key, value, allowed)
            raise InvalidConfigError(f"{where}{key}", value, error.problem, error.remedy)


def load_experiment(path: str | Path, environ: Mapping[str, str]) -> Experiment:
    """Resolve an experiment file into identity keys and flat params (not yet typed)."""
    path = Path(path)
    data = load_yaml(path, environ)
    _check_keys(data, _EXPERIMENT_KEYS, "")
    modules = data.get("modules") or {}
    if not isinstance(modules, dict) or "pre_trainer" not in modules:
        raise InvalidConfigError(
            "modules.pre_trainer", None, "missing", "Add modules: {pre_trainer: {framework: megatron, ...}}"
        )
    _check_keys(modules, ("pre_trainer",), "modules.")
    module = modules["pre_trainer"] or {}
    _check_keys(module, _MODULE_KEYS, "modules.pre_trainer.")
    framework = module.get("framework")
    if framework != "megatron":
        raise UnsupportedSettingError(
            "modules.pre_trainer.framework",
            framework,
            "only megatron is implemented",
            "Set framework: megatron",
        )
    params: dict[str, Any] = {}
    source: dict[str, str] = {}
    for kind, name in (("models", module.get("model")), ("modules", module.get("config"))):
        if name is None:
            continue
        preset_path = _find_preset(str(name), kind, path.parent)
        preset = load_yaml(preset_path, environ)
        _merge_flat(params, source, preset, str(preset_path))
    overrides = module.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise InvalidConfigError("modules.pre_trainer.overrides", overrides, "must be a mapping")
    _merge_flat(params, source, overrides, str(path))
    identity = {k: data[k] for k in _EXPERIMENT_KEYS if k != "modules" and k in data}
    return Experiment(path=path, identity=identity, params=params, source=source)


def _merge_flat(params: dict[str, Any], source: dict[str, str], new: dict[str, Any], origin: str) -> None:
    for key, value in new.items():
        params[key] = value
        source[key] = origin


def dump_experiment(identity: dict[str, Any], params: dict[str, Any]) -> str:
    """An experiment YAML that reproduces ``params`` exactly (no presets): ``--export_config``."""
    document = {
        **identity,
        "modules": {"pre_trainer": {"framework": "megatron", "overrides": params}},
    }
    return yaml.dump(document, Dumper=_FlowListDumper, sort_keys=False, width=110)


class _FlowListDumper(yaml.SafeDumper):
    """Block mappings, one key a line; lists on one line (layer patterns stay readable)."""


_FlowListDumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)
