"""From an experiment file plus CLI overrides to a typed :class:`PretrainConfig`, in one call.

Order: experiment YAML (presets, ``extends``, ``${VAR}``) -> ``--key value`` overrides -> strict typing
by annotation. The flat params are kept alongside so ``--export_config`` writes exactly what ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megamoe.train.convert import build_config
from megamoe.train.loader import dump_experiment, load_experiment
from megamoe.train.overrides import apply_overrides, parse_overrides
from megamoe.train.schema import PretrainConfig


@dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
    """The typed config and the flat key/value view it came from (plus where each value was set)."""

    config: PretrainConfig
    source: dict[str, str]
    """Flat key -> the preset or experiment file that set it last, or ``cli``."""

    def export(self) -> str:
        """The effective config as an experiment YAML that reproduces this run without presets."""
        return export_yaml(self.config)

    def provenance(self) -> str:
        """``# key: file`` lines for every value a file or the command line set (the rest are defaults)."""
        width = max((len(k) for k in self.source), default=0)
        return "".join(f"# {key:<{width}}  {origin}\n" for key, origin in sorted(self.source.items()))


def export_yaml(c: PretrainConfig) -> str:
    """``c`` as an experiment YAML without presets (``--export_config``, each checkpoint's config.yaml)."""
    identity = {
        "work_group": c.work_group,
        "user_name": c.user_name,
        "exp_name": c.exp_name,
        "workspace": c.workspace,
    }
    return dump_experiment(identity, c.params())


def resolve_config(path: str | Path, overrides: Sequence[str], environ: Mapping[str, str]) -> ResolvedConfig:
    """Load ``path``, apply ``overrides`` (argv items), type and check every key."""
    experiment = load_experiment(path, environ)
    pairs = parse_overrides(overrides)
    identity, params = apply_overrides(experiment.identity, experiment.params, pairs)
    source: dict[str, Any] = dict(experiment.source)
    source.update({key: "cli" for key, _ in pairs})
    return ResolvedConfig(config=build_config(identity, params), source=source)
