"""MegaMoE against the torch ``_grouped_mm`` pipeline at small token counts, eager and in CUDA graphs.

    python -m benchmarks.sweep_small_t [--tokens 256,512,...] [--shapes H1024-E8-K2,...]
        [--out DIR] [--cprofile SHAPE:T] [--dry-run]

At a few thousand tokens the expert path's math takes tens of microseconds, so what the host does
per call (Python, argument packing, allocations, one launch per kernel) decides the time. For each
shape x T this times fwd+bwd of ``fused_mega_moe`` (Triton backend) and of
:func:`benchmarks.bench.baseline_layer`, interleaved in one process (:func:`time_interleaved`, L2
flushed), two ways:

* ``eager``: the call as a training step issues it; when the host is slower than the GPU, the GPU
  waits and the event-timed ms is the host's;
* ``graph``: the same fwd+bwd captured once in a CUDA graph and replayed (launch cost gone).

and per implementation, once: ``host ms`` (issuing one call while the GPU is held busy, so only the
host's work counts) and ``launches`` (kernels, copies and memsets the profiler sees in one call).
Both are measured with ``torch.autograd.grad`` of a fixed output gradient, so nothing accumulates.

Written under ``--out`` (default ``./output/bench/sweep_small_t/<time>``): ``table.md`` (printed too),
``results.json`` and ``speedup.png`` (ours / torch speed-up against T per shape, eager and graph).
``--cprofile H1024-E8-K2:1024`` also writes ``cprofile.txt``: where the host time of our eager call
goes, by Triton launch (the host's microseconds in each kernel's launch) and by Python function.
Without matplotlib on the GPU machine the plot is skipped; ``--replot DIR`` draws it (and rewrites the
table) from ``DIR/results.json`` anywhere.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

from benchmarks.bench import _inputs, baseline_layer
from benchmarks.common import SMALL_T_SHAPES, ModelShape, capture, time_interleaved
from benchmarks.train_runs import ROOT

TOKENS = (256, 512, 1024, 2048, 4096, 8192)
IMPLS = ("megamoe", "torch")
HOLD_CYCLES = 200_000_000
"""GPU cycles a spin kernel keeps the stream busy (~100 ms) while the host issues the calls whose
host time is measured."""


@dataclass(slots=True)
class Row:
    shape: str
    tokens: int
    impl: str
    eager_ms: float
    graph_ms: float
    host_ms: float
    launches: int


def _shape(name: str, tokens: int) -> ModelShape:
    hidden, inter, experts, topk = SMALL_T_SHAPES[name]
    return ModelShape(hidden=hidden, inter=inter, experts=experts, topk=topk, tokens=tokens)


def _steps(shape: ModelShape, *, device: torch.device | None = None, precision: str = "bf16"):
    """``{impl: step}``: one fwd+bwd returning ``(y, dx, d_topk_weights, dw1, dw2)``, on shared inputs
    (on ``device``, default the GPU; ``precision``: our expert GEMMs')."""
    from megamoe import fused_mega_moe

    x, idx, tw, w1, w2 = _inputs(shape, "uniform", device or torch.device("cuda"))
    leaves = [x, tw, w1, w2]
    dy = torch.randn_like(x)

    def ours():
        y = fused_mega_moe(x, idx, tw, w1, w2, backend="triton", precision=precision)
        return (y, *torch.autograd.grad(y, leaves, dy))

    def torch_pipeline():
        y = baseline_layer(x, idx, tw, w1, w2)
        return (y, *torch.autograd.grad(y, leaves, dy))

    return {"megamoe": ours, "torch": torch_pipeline}


def host_ms(step, calls: int = 8) -> float:
    """Host time to issue one ``step`` while the GPU is busy with a spin kernel. Few calls: past about
    a thousand pending launches the driver makes the host wait for the GPU."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * elapsed / calls


def launches(step) -> int:
    """Kernels, copies and memsets of one ``step``, as the profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(name: str, tokens: int) -> list[Row]:
    steps = _steps(_shape(name, tokens))
    eager = time_interleaved([(fn, []) for fn in steps.values()])
    replays = {impl: capture(step, warmup=3)[0].replay for impl, step in steps.items()}
    graph = time_interleaved([(fn, []) for fn in replays.values()])
    rows = []
    for (impl, step), e_ms, g_ms in zip(steps.items(), eager, graph, strict=True):
        rows.append(Row(name, tokens, impl, e_ms, g_ms, host_ms(step), launches(step)))
    return rows


def format_table(rows: list[Row]) -> str:
    """One line per shape x T: each impl's eager / graph ms, host ms and launches; ours over torch."""
    by_key: dict[tuple[str, int], dict[str, Row]] = {}
    for r in rows:
        by_key.setdefault((r.shape, r.tokens), {})[r.impl] = r
    lines = [
        "| shape | T | ours eager ms | torch eager ms | **eager speed-up** | ours graph ms | torch graph ms "
        "| **graph speed-up** | ours host ms | torch host ms | ours launches | torch launches |",
        "|" + "---|" * 12,
    ]
    for (shape, tokens), by in by_key.items():
        o, t = by["megamoe"], by["torch"]
        lines.append(
            f"| {shape} | {tokens} | {o.eager_ms:.3f} | {t.eager_ms:.3f} | {t.eager_ms / o.eager_ms:.2f}x | "
            f"{o.graph_ms:.3f} | {t.graph_ms:.3f} | {t.graph_ms / o.graph_ms:.2f}x | {o.host_ms:.3f} | "
            f"{t.host_ms:.3f} | {o.launches} | {t.launches} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Speed-up (torch ms / ours ms) against T, one colour per shape, eager solid and graph dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, shape in enumerate(dict.fromkeys(r.shape for r in rows)):
        ours = {r.tokens: r for r in rows if r.shape == shape and r.impl == "megamoe"}
        base = {r.tokens: r for r in rows if r.shape == shape and r.impl == "torch"}
        tokens = sorted(ours)
        for mode, style in (("eager", "-"), ("graph", "--")):
            ratio = [getattr(base[t], f"{mode}_ms") / getattr(ours[t], f"{mode}_ms") for t in tokens]
            ax.plot(tokens, ratio, style, marker="o", color=f"C{i}", label=f"{shape} {mode}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("speed-up over the torch _grouped_mm pipeline")
    ax.set_title("fwd+bwd, one GPU: MegaMoE / torch (> 1: MegaMoE faster)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def launch_costs(step, calls: int = 8) -> str:
    """Host time per call, and the part of it in each Triton kernel's launch (argument binding, tensor
    descriptors, the driver call), the GPU held busy as in :func:`host_ms`."""
    from triton.runtime.jit import JITFunction

    spent: dict[str, list[float]] = {}
    launch = JITFunction.run

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return launch(self, *args, **kwargs)
        finally:
            spent.setdefault(self.fn.__name__, []).append(time.perf_counter() - start)

    total_ms = host_ms(step, calls)
    JITFunction.run = timed
    try:
        torch.cuda._sleep(HOLD_CYCLES)
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    finally:
        JITFunction.run = launch
    per_call = {k: (len(v) // calls, 1e6 * sum(v) / len(v)) for k, v in spent.items()}
    lines = [f"host {1e3 * total_ms:.0f} us a call; Triton launches, us each (count a call):"]
    lines += [
        f"  {k:36s} {us:6.1f}  x{n}" for k, (n, us) in sorted(per_call.items(), key=lambda kv: -kv[1][1])
    ]
    in_launches = sum(n * us for n, us in per_call.values())
    lines.append(f"  in Triton launches: {in_launches:.0f} us a call")
    return "\n".join(lines)


def host_profile(name: str, tokens: int, calls: int = 50) -> str:
    """Triton's launches' share of the host time (:func:`launch_costs`), then cProfile of ``calls`` eager
    fwd+bwd of ours, the 40 functions of most cumulative time."""
    step = _steps(_shape(name, tokens))["megamoe"]
    launches_text = launch_costs(step)
    profiler = cProfile.Profile()
    torch.cuda._sleep(HOLD_CYCLES)
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    return (
        f"{launches_text}\n\n{calls} calls of fused_mega_moe fwd+bwd at {name} T={tokens}\n{text.getvalue()}"
    )


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def _names(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in SMALL_T_SHAPES]
    if bad:
        raise click.BadParameter(f"unknown shape(s) {bad}; choose from {', '.join(SMALL_T_SHAPES)}")
    return names


@click.command(help=__doc__)
@click.option("--tokens", default=",".join(map(str, TOKENS)), show_default=True, help="comma-separated T")
@click.option(
    "--shapes", default=",".join(SMALL_T_SHAPES), show_default=True, help="comma-separated shape names"
)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="output folder")
@click.option(
    "--cprofile", "cprofile_at", default=None, help="SHAPE:T whose host time to profile by function"
)
@click.option(
    "--replot", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
    help="draw speedup.png and table.md from DIR/results.json, run nothing",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="print the cases and exit without touching the GPU")
def main(
    tokens: str, shapes: str, out: Path | None, cprofile_at: str | None, replot: Path | None, dry_run: bool
) -> None:
    if replot is not None:
        record = json.loads((replot / "results.json").read_text())
        rows = [Row(**r) for r in record["rows"]]
        header = f"{record['device']}, torch {record['torch']}, fwd+bwd, uniform routing, bf16"
        (replot / "table.md").write_text(f"{header}\n\n{format_table(rows)}\n")
        plot(rows, replot / "speedup.png")
        click.echo(f"written: {replot}/table.md, speedup.png")
        return
    names, token_list = _names(shapes), _ints(tokens)
    if cprofile_at is not None:
        shape, _, t = cprofile_at.partition(":")
        _names(shape)
        if not t.isdigit():
            raise click.BadParameter(
                f"{cprofile_at!r}: want SHAPE:T, e.g. H1024-E8-K2:1024", param_hint="--cprofile"
            )
    if dry_run:
        for name in names:
            click.echo(f"{name} {SMALL_T_SHAPES[name]} T={token_list}")
        return
    if not torch.cuda.is_available():
        raise click.ClickException("the sweep needs a CUDA GPU (torch.cuda.is_available() is False)")
    out = (out or ROOT / "output/bench/sweep_small_t" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    measure(names[0], token_list[0])  # a process's first point pays its warm-up in host time: not kept
    for name in names:
        for t in token_list:
            rows += measure(name, t)
            click.echo(format_table(rows[-2:]).splitlines()[-1], err=True)
            torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    header = f"{props.name}, torch {torch.__version__}, fwd+bwd, uniform routing, bf16"
    text = f"{header}\n\n{format_table(rows)}\n"
    click.echo(text)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(
            {"device": props.name, "torch": torch.__version__, "rows": [asdict(r) for r in rows]}, indent=1
        )
    )
    try:
        plot(rows, out / "speedup.png")
    except ImportError:
        click.echo(
            f"matplotlib not installed: no plot (python -m benchmarks.sweep_small_t --replot {out})", err=True
        )
    if cprofile_at is not None:
        shape, _, t = cprofile_at.partition(":")
        (out / "cprofile.txt").write_text(host_profile(shape, int(t)))
    click.echo(f"written: {out}/table.md, results.json, speedup.png", err=True)


if __name__ == "__main__":
    main()
