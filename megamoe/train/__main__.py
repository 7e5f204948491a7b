"""``python -m megamoe.train pretrain --config X [--key value ...]``: the entry the launcher runs."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from megamoe.errors import MegaMoEError
from megamoe.train import distributed
from megamoe.train.config import resolve_config
from megamoe.train.logs import setup_logging
from megamoe.train.validate import plan_run

logger = logging.getLogger("megamoe.train")

_PASS_THROUGH = {
    "ignore_unknown_options": True,
    "allow_extra_args": True,
    "help_option_names": ["-h", "--help"],
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """megatron-core training with MegaMoE, configured by Primus-format experiment YAMLs."""


@cli.command(context_settings=_PASS_THROUGH)
@click.option(
    "--config",
    "--exp",
    "config",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Experiment YAML (Primus format).",
)
@click.option(
    "--export_config",
    "--export-config",
    "export_config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the effective config (an experiment YAML without presets) to this file.",
)
@click.option(
    "--dry-run",
    "--dry_run",
    "dry_run",
    is_flag=True,
    help="Resolve and check the config, print it (and where each value was set) and the run plan; train nothing.",
)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def pretrain(config: Path, export_config: Path | None, dry_run: bool, overrides: tuple[str, ...]) -> None:
    """Pretrain a GPT/MoE model from an experiment YAML; settings given as --key value, --key=value or a
    bare --flag (true) override it. Every key and rule: docs/training.md.

    \b
    torchrun --nproc_per_node 2 -m megamoe.train pretrain \\
        --config examples/megatron/configs/cpu/moe_tiny-pretrain.yaml --train_iters 40 --lr 1e-3
    """
    environ = distributed.environ_snapshot()
    info = distributed.rank_info(environ)
    try:
        resolved = resolve_config(config, overrides, environ)
        cfg = resolved.config
        setup_logging(info.rank, cfg.logging.stderr_sink_level)
        if export_config and info.rank == 0:
            export_config.parent.mkdir(parents=True, exist_ok=True)
            export_config.write_text(resolved.export())
            logger.info("effective config written to %s", export_config)
        if dry_run:
            plan = plan_run(cfg, world_size=info.world_size, has_cuda=_has_cuda())
            click.echo(resolved.export(), nl=False)
            click.echo("# where each non-default value was set:\n" + resolved.provenance(), nl=False)
            click.echo("# run plan: " + json.dumps({k: str(v) for k, v in plan.__dict__.items()}))
            return
        from megamoe.train.loop import pretrain as run

        run(cfg, environ)
    except MegaMoEError as e:
        raise click.UsageError(str(e)) from e


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    cli(prog_name="python -m megamoe.train")


if __name__ == "__main__":
    sys.exit(main())
