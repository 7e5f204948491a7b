"""``python -m megamoe.train check --world-size N --config X [--key value ...]``: the launcher's preflight.

It resolves and validates the config exactly as ``pretrain`` does at start-up (``resolve_config``,
then ``plan_run`` for N ranks) in one quick process that starts neither megatron nor a process
group. ``primus-cli`` runs it once before any hook or rank, so a config that cannot start costs
one line instead of one error per rank. It prints one JSON object on stdout and exits 0, or 2 when
the config cannot start::

    {"ok": true, "output_dir": "./output/megamoe/demo/moe_tiny-pretrain", "world_size": 2, ...}
    {"ok": false, "error": "num_experts=8: not divisible by expert_model_parallel_size=3. ..."}

It takes every argument ``pretrain`` takes, so the launcher passes them as typed (``--export_config``
and ``--dry-run`` are accepted and ignored: they change what a run writes, not whether it starts).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import click

from megamoe.errors import MegaMoEError
from megamoe.train.config import resolve_config
from megamoe.train.validate import plan_run


def _one_line(message: str) -> str:
    """A message as one line (a YAML error spans several)."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": ["-h", "--help"],
    }
)
@click.option(
    "--world-size",
    "--world_size",
    "world_size",
    required=True,
    type=click.IntRange(min=1),
    help="Ranks the run will have (nodes x processes per node).",
)
@click.option(
    "--cuda/--no-cuda",
    default=None,
    help="Whether the ranks will have GPUs (default: whether this process sees one).",
)
@click.option(
    "--config",
    "--exp",
    "config",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Experiment YAML (Primus format), as for pretrain.",
)
@click.option("--export_config", "--export-config", "export_config", hidden=True)
@click.option("--dry-run", "--dry_run", "dry_run", is_flag=True, hidden=True)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def check(
    world_size: int,
    cuda: bool | None,
    config: Path,
    export_config: str | None,
    dry_run: bool,
    overrides: tuple[str, ...],
) -> None:
    """Check a pretrain config for WORLD_SIZE ranks without starting them; print one JSON verdict.

    \b
    python -m megamoe.train check --world-size 2 \\
        --config examples/megatron/configs/cpu/moe_tiny-pretrain.yaml --expert_model_parallel_size 2
    """
    try:
        cfg = resolve_config(config, overrides, dict(os.environ)).config
        plan = plan_run(cfg, world_size=world_size, has_cuda=_has_cuda() if cuda is None else cuda)
    except MegaMoEError as e:
        click.echo(json.dumps({"ok": False, "error": _one_line(str(e))}))
        raise SystemExit(2) from e
    verdict = {"ok": True, "output_dir": cfg.output_dir, **dataclasses.asdict(plan)}
    click.echo(json.dumps(verdict, default=str))
