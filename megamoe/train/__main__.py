"""``python -m megamoe.train pretrain --config X [--key value ...]``: the entry the launcher runs."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import click

from megamoe.errors import MegaMoEError
from megamoe.train import distributed
from megamoe.train import tokenizer as tokenizers
from megamoe.train.config import resolve_config
from megamoe.train.logs import setup_logging
from megamoe.train.preflight import check
from megamoe.train.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Interrupted, Preempted
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
        _fail(e)
    except (Preempted, Interrupted) as e:
        if info.rank == 0:
            logger.warning("%s", e)
        sys.exit(PREEMPTED_EXIT_CODE if isinstance(e, Preempted) else INTERRUPTED_EXIT_CODE)


def _split_list(values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(item for value in values for item in value.split(",") if item)


@cli.command("prepare-data", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--input",
    "inputs",
    multiple=True,
    required=True,
    help="JSON-lines (.jsonl/.json) or text (.txt, a document a line) files, optionally .gz; comma-separated or repeated.",
)
@click.option(
    "--output-prefix",
    required=True,
    help="Output path prefix: writes PREFIX_<key>_document.bin/.idx per JSON key.",
)
@click.option(
    "--json-keys",
    multiple=True,
    default=("text",),
    show_default=True,
    help="Keys of the JSON objects to tokenize; comma-separated or repeated.",
)
@click.option(
    "--tokenizer-type",
    required=True,
    type=click.Choice(tokenizers.TOKENIZER_TYPES),
    help="Megatron-LM's tokenizer type.",
)
@click.option(
    "--tokenizer-model",
    help="Local tokenizer: a HuggingFace tokenizer directory (tokenizer.json) or a SentencePiece .model file.",
)
@click.option("--vocab-size", type=click.IntRange(min=1), help="Token ids of the NullTokenizer.")
@click.option("--append-eod", is_flag=True, help="Append the end-of-document token to every document.")
@click.option(
    "--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Tokenizer processes."
)
@click.option(
    "--skip-bad-lines",
    is_flag=True,
    help="Skip (and count) lines that are not JSON or lack a key, instead of stopping.",
)
@click.option(
    "--log-interval",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Lines between progress lines when stderr is not a terminal.",
)
def prepare_data(**options: object) -> None:
    """Tokenize a corpus into megatron indexed datasets (the flags of Megatron-LM's preprocess_data.py).

    \b
    python -m megamoe.train prepare-data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer/ --json-keys text --append-eod --workers 2
    """
    from megamoe.train.prepare_data import PrepareSettings, prepare

    setup_logging(0)
    settings = PrepareSettings(
        inputs=tuple(Path(p) for p in _split_list(options.pop("inputs"))),
        json_keys=_split_list(options.pop("json_keys")),
        **options,
    )
    try:
        summary = prepare(settings)
    except MegaMoEError as e:
        _fail(e)
    click.echo(summary.text())


def _fail(error: MegaMoEError) -> NoReturn:
    """One line on stderr and exit status 2: the message names the setting, the problem and the remedy."""
    click.echo(f"error: {error}", err=True)
    sys.exit(2)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


cli.add_command(check)


def main() -> None:
    # Tokenizers load from local paths only; the hub libraries must never try the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cli(prog_name="python -m megamoe.train")


if __name__ == "__main__":
    sys.exit(main())
