"""The Python work of one eager fwd+bwd, measured on a CPU: every Triton launch a no-op.

    python -m benchmarks.host_python_work [--shape H1024-E8-K2] [--tokens 256] [--precision bf16,fp8]
        [--calls 200] [--rounds 7] [--cprofile N]

At small T the host's time per call is the layer's time (docs/benchmarks.md#small-token-counts-eager-and-in-cuda-graphs).
On a GPU machine that time is Python, kernel launches, allocations and autograd's engine together; this
takes the launches out. It runs ``fused_mega_moe`` (Triton backend) on CPU tensors in Triton's
interpreter mode with every kernel launch, and ``torch._assert_async`` (the expert-id check's one
launch on a GPU), replaced by a no-op, so what is timed is our Python, autograd's engine and CPU
allocations. The outputs are garbage: nothing here checks them. On a GPU a few paths differ (the
backward's small gathers are one ``index_select`` there, a Triton kernel here), so the figures compare
versions of the code on one machine, not this machine with a GPU host.

Prints, per precision, the microseconds per fwd+bwd of the quickest of ``--rounds`` rounds of
``--calls`` calls; ``--cprofile N`` adds the N functions of most own time.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
from collections.abc import Callable

import click

from benchmarks.common import SMALL_T_SHAPES

PRECISIONS = ("bf16", "fp8", "mxfp8")


def _no_launches() -> None:
    """Interpret Triton kernels and make every launch (and the device-side assert) return at once. Call
    before anything imports triton: the interpreter is chosen when a kernel is defined."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.run = lambda self, *args, **kwargs: None
    torch._assert_async = lambda *args, **kwargs: None


def _step(shape: str, tokens: int, precision: str) -> Callable[[], object]:
    """:mod:`benchmarks.sweep_small_t`'s fwd+bwd of ours, on CPU tensors (imported once launches are off)."""
    import torch

    from benchmarks import sweep_small_t

    steps = sweep_small_t._steps(
        sweep_small_t._shape(shape, tokens), device=torch.device("cpu"), precision=precision
    )
    return steps["megamoe"]


def microseconds_per_call(step: Callable[[], object], calls: int, rounds: int) -> float:
    """The least over ``rounds`` of the mean time of ``calls`` back-to-back calls, after a warm-up: the
    work itself, as ``timeit`` takes it (what the machine's other tasks add only ever lengthens a round)."""
    for _ in range(5):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        times.append(1e6 * (time.perf_counter() - start) / calls)
    return min(times)


def own_time_profile(step: Callable[[], object], calls: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def _precisions(value: str) -> list[str]:
    names = [p.strip() for p in value.split(",") if p.strip()]
    unknown = [p for p in names if p not in PRECISIONS]
    if unknown or not names:
        raise click.BadParameter(f"{unknown or value!r}: choose from {', '.join(PRECISIONS)}")
    return names


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--shape", type=click.Choice(list(SMALL_T_SHAPES)), default="H1024-E8-K2", show_default=True)
@click.option("--tokens", type=click.IntRange(min=1), default=256, show_default=True, help="T")
@click.option("--precision", "precisions", default="bf16,fp8", show_default=True, help="comma-separated")
@click.option("--calls", type=click.IntRange(min=1), default=200, show_default=True, help="calls per round")
@click.option("--rounds", type=click.IntRange(min=1), default=7, show_default=True)
@click.option(
    "--cprofile", "top", type=click.IntRange(min=0), default=0, help="list the N functions of most own time"
)
def main(shape: str, tokens: int, precisions: str, calls: int, rounds: int, top: int) -> None:
    names = _precisions(precisions)
    _no_launches()
    for precision in names:
        step = _step(shape, tokens, precision)
        us = microseconds_per_call(step, calls, rounds)
        click.echo(f"{shape} T={tokens} {precision}: {us:.0f} us of Python work per fwd+bwd")
        if top:
            click.echo(own_time_profile(step, calls, top))


if __name__ == "__main__":
    main()
