"""Kernel timeline of one forward + backward of the one-GPU Triton layer, or of a peer's (torch.profiler).

Shows where the layer's time goes and which kernels overlap, e.g. the wgrads' row gathers on their
side stream beside the dgrad GEMMs::

    python -m benchmarks.profile_layer --model DeepSeek-V3 [--routing uniform] [--precision bf16]
    python -m benchmarks.profile_layer --model Qwen3-235B-A22B --impl sonic   # SonicMoE, same inputs

``--impl`` picks whose expert path runs on the same inputs: ``megamoe`` (ours), ``torch`` (the bench's
torch pipeline) or ``sonic`` (SonicMoE, :mod:`benchmarks.sonic`; warm-up steps tune its GEMMs).

A quantised precision's step starts an optimizer step (the weights quantised once in it, as in training
without gradient accumulation). Prints one markdown row per kernel or copy: name, stream, start (ms from the first event) and
duration, then the busy time per stream. Needs a CUDA GPU; ``--dry-run`` prints the plan only.
"""

from __future__ import annotations

import click
import torch

from benchmarks.bench import BASELINES
from benchmarks.common import MODELS, make_routing

IMPLS = ("megamoe", *BASELINES)


def _layer_step(model: str, routing: str, precision: str, impl: str):
    from megamoe import advance_weight_generation, fused_mega_moe

    shape = MODELS[model]
    dev = torch.device("cuda")
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
    w1 = (torch.randn(G, 2 * I, H, device=dev, generator=gen) / H**0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(G, H, I, device=dev, generator=gen) / I**0.5).bfloat16().requires_grad_()
    idx, tw = make_routing(shape, routing, device=dev, seed=0)
    tw = tw.bfloat16().requires_grad_()
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)

    def ours():
        if precision != "bf16":
            advance_weight_generation()  # an optimizer step: the weights quantised once in the step
        return fused_mega_moe(x, idx, tw, w1, w2, backend="triton", precision=precision)

    forward = ours if impl == "megamoe" else lambda: BASELINES[impl][1](x, idx, tw, w1, w2)

    def step() -> None:
        torch.autograd.grad(forward(), [x, tw, w1, w2], dy)

    return step


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", type=click.Choice(sorted(MODELS)), default="DeepSeek-V3", show_default=True)
@click.option("--routing", type=click.Choice(["uniform", "skewed"]), default="uniform", show_default=True)
@click.option("--precision", type=click.Choice(["bf16", "mxfp8", "fp8"]), default="bf16", show_default=True)
@click.option(
    "--impl", type=click.Choice(IMPLS), default="megamoe", show_default=True, help="whose expert path"
)
@click.option("--dry-run", is_flag=True, help="print what would be profiled and exit")
def main(model: str, routing: str, precision: str, impl: str, dry_run: bool) -> None:
    """Profile one forward + backward of the Triton layer (or a peer's) at MODEL's per-rank shape."""
    if impl != "megamoe" and precision != "bf16":
        raise click.BadParameter(f"the peers run bf16 only, not {precision}", param_hint="--precision")
    plan = f"{impl}, {model}, {routing} routing, {precision}: 3 warm-up steps, then one profiled step"
    if dry_run:
        click.echo(f"would profile {plan}")
        return
    if not torch.cuda.is_available():
        raise click.ClickException("profile_layer needs a CUDA GPU (use --dry-run to see the plan)")
    from torch.profiler import ProfilerActivity, profile

    step = _layer_step(model, routing, precision, impl)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda._sleep(10_000_000)  # the host enqueues the step while the GPU spins: device time only
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = sorted(
        (
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" not in e.name
        ),
        key=lambda e: e.time_range.start,
    )
    if not events:
        raise click.ClickException("the profiler recorded no GPU events")
    t0 = events[0].time_range.start
    busy: dict[str, float] = {}
    click.echo(f"{torch.cuda.get_device_name()}: {plan}\n")
    click.echo("| kernel or copy | stream | start ms | ms |\n|---|---|---|---|")
    for e in events:
        stream = str(getattr(e, "device_resource_id", "?"))
        ms = (e.time_range.end - e.time_range.start) / 1e3
        busy[stream] = busy.get(stream, 0.0) + ms
        click.echo(f"| {e.name[:60]} | {stream} | {(e.time_range.start - t0) / 1e3:.3f} | {ms:.3f} |")
    end = max(e.time_range.end for e in events)
    click.echo(f"\nfirst start to last end: {(end - t0) / 1e3:.3f} ms; busy per stream: "
               + ", ".join(f"{s} {ms:.3f} ms" for s, ms in busy.items()))  # fmt: skip


if __name__ == "__main__":
    main()
