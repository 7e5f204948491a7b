"""What the two size-switched host paths cost at small token counts: the backward's side-stream row
gathers and the routing plan's four launches, each against its small-size alternative.

    python -m benchmarks.ab_small_t_paths [--cases H1024-E8-K2:4096,...] [--out DIR] [--dry-run]

Two thresholds pick a path by size: ``side_gather.SIDE_STREAM_MIN_BYTES`` (a gather at least this big
runs on a side stream beside the GEMM: a stream fork and join, a zeroed counter and a persistent
gather, against one ``index_select`` in order) and ``routing.ONE_PROGRAM_CELLS`` (above it the plan is
four launches over many programs, below one program). Each case times, interleaved in one process, the
fwd+bwd of ``fused_mega_moe`` (Triton backend) under four settings (the gathers on the side stream
from 16 MiB or all in order, each with the plan as the package builds it or in one program at every
size) and the torch pipeline's: eager ms, ms replayed from a CUDA graph (the GPU's time alone), host
ms and launches, as :mod:`benchmarks.sweep_small_t` measures them.

Written under ``--out`` (default ``./output/bench/ab_small_t_paths/<time>``): ``results.json`` and
``table.md`` (printed too).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

from benchmarks import sweep_small_t
from benchmarks.common import SMALL_T_SHAPES, capture, time_interleaved
from benchmarks.train_runs import ROOT
from megamoe.backends.triton import routing, side_gather

NEVER = 1 << 62
SIDE_FROM_16_MIB = 16 << 20
"""the side-stream threshold before the A/B in docs/benchmarks.md moved it to 128 MiB"""
SETTINGS = {
    # name: (SIDE_STREAM_MIN_BYTES, ONE_PROGRAM_CELLS); None keeps the package's value
    "side stream from 16 MiB": (SIDE_FROM_16_MIB, None),
    "gathers in order": (NEVER, None),
    "side stream from 16 MiB, plan in one program": (SIDE_FROM_16_MIB, NEVER),
    "gathers in order, plan in one program": (NEVER, NEVER),
}
CASES = (
    "H1024-E8-K2:1024,H1024-E8-K2:4096,H1024-E8-K2:8192,H2048-E32-K4:1024,H2048-E32-K4:4096,"
    "H2048-E32-K4:8192,H4096-E64-K8:256,H4096-E64-K8:1024,H4096-E64-K8:2048"
)
HOST_ROUNDS = 5


@dataclass(slots=True)
class Row:
    case: str
    setting: str
    eager_ms: float
    graph_ms: float
    host_ms: float
    launches: int


def _under(setting: str, step: Callable[[], object]) -> Callable[[], object]:
    """``step`` with the thresholds of ``setting`` in force for its call (the backward included)."""
    gather_bytes, plan_cells = SETTINGS[setting]
    defaults = (side_gather.SIDE_STREAM_MIN_BYTES, routing.ONE_PROGRAM_CELLS)

    def run():
        side_gather.SIDE_STREAM_MIN_BYTES = defaults[0] if gather_bytes is None else gather_bytes
        routing.ONE_PROGRAM_CELLS = defaults[1] if plan_cells is None else plan_cells
        try:
            return step()
        finally:
            side_gather.SIDE_STREAM_MIN_BYTES, routing.ONE_PROGRAM_CELLS = defaults

    return run


def measure(case: str) -> list[Row]:
    name, _, tokens = case.partition(":")
    steps = sweep_small_t._steps(sweep_small_t._shape(name, int(tokens)))
    fns = {setting: _under(setting, steps["megamoe"]) for setting in SETTINGS} | {"torch": steps["torch"]}
    eager = time_interleaved([(fn, []) for fn in fns.values()])
    graph = time_interleaved([(capture(fn, warmup=3)[0].replay, []) for fn in fns.values()])
    host = {setting: [] for setting in fns}
    for _ in range(HOST_ROUNDS):  # interleaved too: the host's pace drifts within a process
        for setting, fn in fns.items():
            host[setting].append(sweep_small_t.host_ms(fn))
    return [
        Row(case, setting, e, g, statistics.median(host[setting]), sweep_small_t.launches(fn))
        for (setting, fn), e, g in zip(fns.items(), eager, graph, strict=True)
    ]


def format_table(rows: list[Row]) -> str:
    lines = [
        "| case | setting | eager ms | graph ms | host ms | launches |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.setting} | {r.eager_ms:.3f} | {r.graph_ms:.3f} | {r.host_ms:.3f} | {r.launches} |"
        )
    return "\n".join(lines)


def _cases(value: str) -> list[str]:
    cases = [c.strip() for c in value.split(",") if c.strip()]
    for case in cases:
        name, _, tokens = case.partition(":")
        if name not in SMALL_T_SHAPES or not tokens.isdigit():
            raise click.BadParameter(
                f"{case!r}: want SHAPE:T with SHAPE one of {', '.join(SMALL_T_SHAPES)}",
                param_hint="--cases",
            )
    return cases


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--cases", default=CASES, show_default=True, help="comma-separated SHAPE:T")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="output folder")
@click.option(
    "--dry-run", is_flag=True, help="print the cases and settings and exit without touching the GPU"
)
def main(cases: str, out: Path | None, dry_run: bool) -> None:
    case_list = _cases(cases)
    if dry_run:
        for case in case_list:
            click.echo(f"{case}: {', '.join(SETTINGS)}, torch")
        return
    if not torch.cuda.is_available():
        raise click.ClickException("the A/B needs a CUDA GPU (torch.cuda.is_available() is False)")
    out = (out or ROOT / "output/bench/ab_small_t_paths" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    measure(case_list[0])  # a process's first case pays its warm-up in host time: not kept
    for case in case_list:
        rows += measure(case)
        click.echo(format_table(rows[-len(SETTINGS) - 1 :]), err=True)
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    text = (
        f"{props.name}, torch {torch.__version__}, fwd+bwd, uniform routing, bf16\n\n{format_table(rows)}\n"
    )
    click.echo(text)
    (out / "table.md").write_text(text)
    record = {"device": props.name, "torch": torch.__version__, "rows": [asdict(r) for r in rows]}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    click.echo(f"written: {out}/table.md, results.json", err=True)


if __name__ == "__main__":
    main()
