"""Job templates and the sbatch script, rendered with jinja2; every value is shell-quoted.

`finalize=shlex.quote` quotes each `{{ value }}` as one shell word, so a value such as
`$(touch /tmp/pwned)` or a pipeline layout `Et|t*2|...` reaches the program literally. Literal
shell syntax in a template is marked `| safe`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from importlib import resources
from typing import Any

import jinja2
from markupsafe import Markup

from runner.errors import ConfigError


def _quote(value: Any) -> str:
    if isinstance(value, Markup):
        return str(value)
    if isinstance(value, (list, tuple)):
        return " ".join(shlex.quote(str(v)) for v in value)
    return shlex.quote("" if value is None else str(value))


def _env() -> jinja2.Environment:
    loader = jinja2.FunctionLoader(
        lambda name: resources.files("runner").joinpath("templates", name).read_text()
    )
    return jinja2.Environment(
        loader=loader,
        finalize=_quote,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_file(name: str, **values: Any) -> str:
    return _env().get_template(name).render(**values)


@dataclass(frozen=True, kw_only=True)
class JobTemplate:
    """A seed job: a runnable bash script (also a valid sbatch script) around one primus-cli call."""

    name: str
    file: str
    description: str
    defaults: dict[str, Any]


_COMMON = {
    "primus_cli": "primus-cli",
    "config": "examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml",
    "num_layers": 4,
    "image": "rocm/primus:v26.5",
    "partition": "",
    "time": "",
    "extra": [],
    "script": "",
    "log_dir": ".",  # sbatch does not create it: an existing directory
}
TEMPLATES = {
    t.name: t
    for t in (
        JobTemplate(
            name="ep8",
            file="job_ep8.sh.j2",
            description="single node, EP8, MegaMoE on (direct mode)",
            defaults={**_COMMON, "nodes": 1, "mode": "direct"},
        ),
        JobTemplate(
            name="ep8-cudagraph",
            file="job_ep8.sh.j2",
            description="single node, EP8, MegaMoE on, full-iteration CUDA-graph capture (direct mode)",
            defaults={**_COMMON, "nodes": 1, "mode": "direct", "cuda_graph": True},
        ),
        JobTemplate(
            name="pp8-8node",
            file="job_pp8.sh.j2",
            description="8 nodes, EP8 + PP8 with an explicit pipeline layout (slurm srun -> container)",
            defaults={
                **_COMMON,
                "nodes": 8,
                "entry": "container",
                "layout": "Ett|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttL",
            },
        ),
    )
}


def parse_sets(pairs: tuple[str, ...]) -> dict[str, Any]:
    """`--set key=value` (repeatable); `extra` accumulates, other keys replace the default."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"--set {pair!r}: expected key=value.")
        if key == "extra":
            out.setdefault("extra", []).append(value)
        else:
            out[key] = value
    return out


def render_job(name: str, sets: dict[str, Any]) -> str:
    if name not in TEMPLATES:
        raise ConfigError(
            f"template {name!r}: unknown. Known: {', '.join(TEMPLATES)} (primus-cli template list)."
        )
    tmpl = TEMPLATES[name]
    unknown = sorted(set(sets) - set(tmpl.defaults) - {"cuda_graph"})
    if unknown:
        raise ConfigError(
            f"template {name}: unknown --set key {unknown[0]!r}. Keys: {', '.join(sorted(tmpl.defaults))}."
        )
    values = {**tmpl.defaults, **sets}
    values.setdefault("cuda_graph", False)
    return render_file(tmpl.file, template=name, **values)
