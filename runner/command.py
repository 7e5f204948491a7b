"""The command at the end of the chain: what it runs, how many times, and which paths it touches.

`train pretrain ...` and `--script FILE ...` run under torchrun, one process per GPU; any other
`train <name> ...` (`train prepare-data ...`) and any `train ... --help` runs once, as one plain
process, because N copies of a data preparation would write the same files at once. A container must see the files the
command reads and the directory it writes: those are named here, from the command's own options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal

from runner.errors import ConfigError

TRAIN_MODULE = "megamoe.train"
DISTRIBUTED_TRAIN_COMMANDS = ("pretrain",)
"""`train` subcommands that torchrun starts on every GPU; the others run once."""
INPUT_OPTIONS = ("--config", "--exp", "--input", "--tokenizer-model")
"""Options whose values are files the command reads (`--input` takes a comma-separated list)."""
OUTPUT_PREFIX_OPTION = "--output-prefix"
"""The option whose value's directory the command writes to."""


def _values(argv: tuple[str, ...], option: str) -> list[str]:
    """Every value of `option` in argv, as `--opt v` or `--opt=v`, kebab or snake case."""
    spellings = {option, "--" + option[2:].replace("-", "_")}
    out = []
    for i, tok in enumerate(argv):
        name, eq, value = tok.partition("=")
        if name in spellings:
            if eq:
                out.append(value)
            elif i + 1 < len(argv):
                out.append(argv[i + 1])
    return out


@dataclass(frozen=True, kw_only=True)
class Command:
    """The trainer (`train <name> ...`) or a script (`--script FILE ...`)."""

    kind: Literal["train", "script"]
    argv: tuple[str, ...]
    """As typed: `("train", "pretrain", "--config", "X")` or `("--script", "f.py", "a")`."""

    @property
    def distributed(self) -> bool:
        """True when torchrun starts it once per GPU; False for a command that must run once
        (`train pretrain --help` too: one copy of the help)."""
        if self.kind == "script":
            return True
        return self.argv[1] in DISTRIBUTED_TRAIN_COMMANDS and not self.asks_for_help()

    @property
    def name(self) -> str:
        """`train pretrain`, `train prepare-data` or `--script FILE`, for messages."""
        return " ".join(self.argv[:2])

    def target(self) -> tuple[str, ...]:
        """What the interpreter runs: `-m megamoe.train pretrain ...` or `FILE args...`."""
        if self.kind == "train":
            return ("-m", TRAIN_MODULE, *self.argv[1:])
        return self.argv[1:]

    def hook_group(self) -> tuple[str, str] | None:
        """`hooks/<group>/<name>/` applies to `train pretrain` as ("train", "pretrain")."""
        if self.kind == "train":
            return self.argv[0], self.argv[1]
        return None

    def asks_for_help(self) -> bool:
        return self.kind == "train" and ("--help" in self.argv or "-h" in self.argv)

    def files(self) -> tuple[str, ...]:
        """Files the command reads that a container must see: the script, `--config`, `--input`
        (each of its comma-separated entries) and `--tokenizer-model`."""
        out = [self.argv[1]] if self.kind == "script" else []
        for option in INPUT_OPTIONS:
            for value in _values(self.argv, option):
                out += [v for v in value.split(",") if v] if option == "--input" else [value]
        return tuple(out)

    def output_dirs(self) -> tuple[str, ...]:
        """Directories the command writes to: the one holding `--output-prefix`."""
        return tuple(str(PurePath(v).parent) for v in _values(self.argv, OUTPUT_PREFIX_OPTION))


def parse_command(tokens: list[str]) -> Command:
    if not tokens:
        raise ConfigError(
            "no command given. Add one after '--': `train pretrain --config FILE [--key value ...]` "
            "or `--script FILE [args]`."
        )
    if tokens[0] == "--script":
        if len(tokens) < 2:
            raise ConfigError("--script needs a file: --script FILE [args].")
        return Command(kind="script", argv=tuple(tokens))
    if tokens[0] == "train":
        if len(tokens) < 2 or tokens[1].startswith("-"):
            raise ConfigError("`train` needs a subcommand: train pretrain --config FILE [--key value ...].")
        return Command(kind="train", argv=tuple(tokens))
    raise ConfigError(
        f"unknown command '{tokens[0]}'. Expected `train pretrain --config FILE [--key value ...]` "
        "or `--script FILE [args]`."
    )
