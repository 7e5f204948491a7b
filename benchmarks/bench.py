"""Benchmark of the expert path on one GPU: MegaMoE's Triton backend against the torchtitan-style pipeline.

    python -m benchmarks.bench --mode dispatch_grouped_gemm|grouped_gemm_combine|layer \\
        --models DeepSeek-V3,Qwen3-30B-A3B,Qwen3-235B-A22B [--routing uniform,skewed] [--fwd-only]

Each model runs the per-rank work of EP8 on one GPU (its local experts, all tokens of the rank, so
R = T*K rows). In the same process it times the baseline — argsort by expert, gather, the first
``torch._grouped_mm``, eager SwiGLU, the second ``torch._grouped_mm``, weighted scatter-add, autograd
backward — and prints ms, TFLOP/s, peak memory above the inputs and ours/baseline ratios. Times are
CUDA-event timed with the L2 cache flushed before each repeat (``triton.testing.do_bench``), in
interleaved rounds: each round times every implementation of a comparison in turn, and each reports
the median over all rounds, so the card's clock drift (it is power-capped and warms up over a run)
falls on both sides alike instead of on whichever ran later. ``layer`` times ``fused_mega_moe``;
the stage modes time one stage alone, split where ours splits, for both: stage 1 = dispatch + GEMM1
+ the SwiGLU forward (ours: in GEMM1's epilogue; the baseline's eager SwiGLU), differentiated through
``h`` only; stage 2 = GEMM2 + combine, whose backward includes the SwiGLU backward (both save ``h``).
``dispatch_grouped_gemm`` also times GEMM1 alone as two pairs on the same rows: our kernel without
an epilogue against a bare ``torch._grouped_mm``, and with its SwiGLU epilogue against
``torch._grouped_mm`` + eager SwiGLU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import click
import torch
from torch import Tensor

from benchmarks.common import MODELS, ModelShape, make_routing, peak_gib, time_interleaved

MODES = ("dispatch_grouped_gemm", "grouped_gemm_combine", "layer")


def baseline_layer(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """torchtitan-style expert path: argsort, gather, grouped_mm, eager SwiGLU, grouped_mm, scatter-add."""
    _, a, order, offs = baseline_stage1(x, topk_idx, w1)
    return baseline_stage2(a, order, offs, topk_weights, w2, x.shape[0])


def baseline_stage1(x: Tensor, topk_idx: Tensor, w1: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(h, a = silu(gate) * up, order, offs)``: the baseline up to and including the eager SwiGLU."""
    K, G = topk_idx.shape[1], w1.shape[0]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.float(), bins=G, min=0, max=G)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x_sorted = x[order // K]
    h = torch._grouped_mm(x_sorted, w1.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    return h, torch.nn.functional.silu(gate) * up, order, offs


class _SwiGLUFromStage1(torch.autograd.Function):
    """The baseline's stage-2 input: ``a`` as stage 1 computed it (no forward work), with the eager
    SwiGLU backward to ``h`` (one ``silu`` more than autograd, which keeps ``silu(gate)`` from forward)."""

    @staticmethod
    def forward(ctx, h: Tensor, a: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        return a.view_as(a)

    @staticmethod
    def backward(ctx, da: Tensor) -> tuple[Tensor, None]:
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        d_gate = torch.ops.aten.silu_backward(da * up, gate)
        return torch.cat([d_gate, da * torch.nn.functional.silu(gate)], dim=-1), None


def baseline_stage2(
    a: Tensor, order: Tensor, offs: Tensor, topk_weights: Tensor, w2: Tensor, T: int
) -> Tensor:
    """GEMM2 on the activation ``a``, then the weighted scatter-add."""
    K = topk_weights.shape[1]
    o = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    w = topk_weights.reshape(-1)[order].unsqueeze(1).to(o.dtype)
    y = torch.zeros(T, o.shape[1], dtype=o.dtype, device=o.device)
    return y.index_add(0, order // K, o * w)


@dataclass(slots=True)
class Result:
    model: str
    routing: str
    mode: str
    phase: str
    impl: str
    ms: float
    tflops: float
    peak_gib: float


def _cases(mode: str, shape: ModelShape, routing: str, device: torch.device, precision: str = "bf16"):
    """Yield ``(impl, forward_fn, leaves)`` for ours and the baseline, on one set of inputs.

    With ``precision="mxfp8"`` ours is the MXFP8 Triton backend and the baseline our own bf16 Triton
    path (the MXFP8 target is relative to it), so the speed-up column is bf16 ms / mxfp8 ms.
    """
    from megamoe import dispatch_grouped_gemm, fused_mega_moe, grouped_gemm_combine

    torch.manual_seed(0)
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    dt = torch.bfloat16
    x = torch.randn(T, H, device=device, dtype=dt).requires_grad_()
    w1 = (torch.randn(G, 2 * I, H, device=device, dtype=dt) / H**0.5).requires_grad_()
    w2 = (torch.randn(G, H, I, device=device, dtype=dt) / I**0.5).requires_grad_()
    idx, tw = make_routing(shape, routing, device=device)
    tw = tw.requires_grad_()
    if precision == "mxfp8":
        yield (
            "megamoe",
            lambda: fused_mega_moe(x, idx, tw, w1, w2, backend="triton", precision="mxfp8"),
            [x, tw, w1, w2],
        )
        yield "baseline", lambda: fused_mega_moe(x, idx, tw, w1, w2, backend="triton"), [x, tw, w1, w2]
    elif mode == "layer":
        yield "megamoe", lambda: fused_mega_moe(x, idx, tw, w1, w2, backend="triton"), [x, tw, w1, w2]
        yield "baseline", lambda: baseline_layer(x, idx, tw, w1, w2), [x, tw, w1, w2]
    elif mode == "dispatch_grouped_gemm":
        yield "megamoe", lambda: dispatch_grouped_gemm(x, idx, tw, w1, backend="triton")[0], [x, w1]
        yield "baseline", lambda: baseline_stage1(x, idx, w1)[0], [x, w1]
    else:
        with torch.no_grad():
            h, dw, handle = dispatch_grouped_gemm(x, idx, tw, w1, backend="triton")
            h_base, a_base, order, offs = baseline_stage1(x, idx, w1)
        # leaves made in place: the handle's activation stays tied to this very h (no SwiGLU pass)
        h.requires_grad_()
        dw.requires_grad_()
        h_base.requires_grad_()
        yield "megamoe", lambda: grouped_gemm_combine(h, dw, handle, w2), [h, dw, w2]
        yield (
            "baseline",
            lambda: baseline_stage2(_SwiGLUFromStage1.apply(h_base, a_base), order, offs, tw, w2, T),
            [h_base, tw, w2],
        )


def _flops(mode: str, shape: ModelShape, rows: int) -> float:
    per_pass = {"layer": 6, "dispatch_grouped_gemm": 4, "grouped_gemm_combine": 2}[mode]
    return per_pass * rows * shape.hidden * shape.inter


def _gemm1_alone(shape: ModelShape, routing: str, device: torch.device) -> list[tuple[str, float]]:
    """GEMM1 alone, two pairs on the same rows; TFLOP/s count the GEMM only.

    Kernel against kernel: ours without an epilogue (gathering ``x`` rows itself) against a bare
    ``torch._grouped_mm`` on rows gathered beforehand (the gather not timed). As the layer runs it:
    ours with the SwiGLU epilogue (``h`` and ``act``) against ``torch._grouped_mm`` + eager SwiGLU.
    """
    from megamoe.backends.triton import ops
    from megamoe.backends.triton.backend import TritonBackend
    from megamoe.backends.triton.configs import gemm_config, num_programs
    from megamoe.backends.triton.grouped_gemm import grouped_gemm
    from megamoe.backends.triton.rows import LocalTransport

    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(G, 2 * I, H, device=device, dtype=torch.bfloat16) / H**0.5
    idx, _ = make_routing(shape, routing, device=device)
    plan = TritonBackend(LocalTransport()).make_plan(idx, num_experts=G, group=None)
    r = plan.routing
    _, _, order, offs = baseline_stage1(x, idx, w1)
    x_sorted = x[order // shape.topk]
    w1_t = w1.transpose(-2, -1)
    h = x.new_empty(T * shape.topk, 2 * I)

    def plain() -> None:
        cfg = gemm_config("gemm1", device)
        grouped_gemm(
            x, w1, h, r, a_mode=1, b_kn=False, config=cfg, num_sms=num_programs(device), a_rows=r.row_token_R
        )

    def grouped_mm_swiglu() -> Tensor:
        gate, up = torch._grouped_mm(x_sorted, w1_t, offs=offs).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    kernel = time_interleaved([(plain, []), (lambda: torch._grouped_mm(x_sorted, w1_t, offs=offs), [])])
    as_run = time_interleaved(
        [
            (lambda: ops.gemm1_forward(x, w1, shape.topk, *plan.routing.kernel_tables()), []),
            (grouped_mm_swiglu, []),
        ]
    )
    names = (
        "gemm1, no epilogue (gather fused)",
        "torch._grouped_mm (pre-gathered)",
        "gemm1 + SwiGLU epilogue (gather fused)",
        "torch._grouped_mm + eager SwiGLU (pre-gathered)",
    )
    return list(zip(names, kernel + as_run, strict=True))


def run(
    mode: str, models: list[str], routings: list[str], fwd_only: bool, precision: str = "bf16"
) -> list[Result]:
    device = torch.device("cuda")
    results: list[Result] = []
    for name in models:
        shape = MODELS[name]
        rows = shape.tokens * shape.topk
        for routing in routings:
            cases = list(_cases(mode, shape, routing, device, precision))
            phases: dict[str, list] = {"fwd": []} if fwd_only else {"fwd": [], "fwd+bwd": []}
            for _impl, forward, leaves in cases:
                grad_out = torch.randn_like(forward())

                def fwd(forward=forward):
                    with torch.no_grad():
                        forward()

                def fwd_bwd(forward=forward, leaves=leaves, grad_out=grad_out):
                    torch.autograd.backward(forward(), grad_out, inputs=leaves)

                phases["fwd"].append((fwd, leaves))
                if not fwd_only:
                    phases["fwd+bwd"].append((fwd_bwd, leaves))
            for phase, timed in phases.items():
                mult = 1 if phase == "fwd" else 3
                for (impl, _, leaves), (fn, _), ms in zip(cases, timed, time_interleaved(timed), strict=True):
                    tflops = mult * _flops(mode, shape, rows) / (ms * 1e-3) / 1e12
                    results.append(Result(name, routing, mode, phase, impl, ms, tflops, peak_gib(fn)))
                    for leaf in leaves:
                        leaf.grad = None
            if mode == "dispatch_grouped_gemm" and precision == "bf16":
                for impl, ms in _gemm1_alone(shape, routing, device):
                    tflops = 4 * rows * shape.hidden * shape.inter / (ms * 1e-3) / 1e12
                    results.append(Result(name, routing, "gemm1", "fwd", impl, ms, tflops, float("nan")))
            torch.cuda.empty_cache()
    return results


def format_table(results: list[Result]) -> str:
    """One line per (model, routing, mode, phase): ours, the baseline and the ratios."""
    rows = [
        "| model | routing | mode | phase | ours ms | ours TFLOP/s | base ms | base TFLOP/s | speed-up | ours GiB | base GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keyed: dict[tuple, dict[str, Result]] = {}
    for r in results:
        keyed.setdefault((r.model, r.routing, r.mode, r.phase), {})[r.impl] = r
    for (model, routing, mode, phase), by_impl in keyed.items():
        ours, base = by_impl["megamoe"], by_impl["baseline"]
        rows.append(
            f"| {model} | {routing} | {mode} | {phase} | {ours.ms:.3f} | {ours.tflops:.0f} | {base.ms:.3f} | "
            f"{base.tflops:.0f} | {base.ms / ours.ms:.3f}x | {ours.peak_gib:.2f} | {base.peak_gib:.2f} |"
        )
    return "\n".join(rows)


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@click.command(help=__doc__)
@click.option("--mode", type=click.Choice(MODES), default="layer", show_default=True)
@click.option("--models", default=",".join(MODELS), show_default=True, help="comma-separated model names")
@click.option(
    "--routing", "routings", default="uniform,skewed", show_default=True, help="uniform and/or skewed"
)
@click.option("--fwd-only", is_flag=True, help="time the forward only")
@click.option(
    "--precision",
    type=click.Choice(["bf16", "mxfp8"]),
    default="bf16",
    show_default=True,
    help="expert GEMM precision; mxfp8 (layer mode) times the MXFP8 Triton backend against our own bf16 "
    "Triton path in the same run (speed-up = bf16 ms / mxfp8 ms; with --num-processes > 1 both over "
    "symmetric memory, and the NCCL pipeline). The weights are re-quantised on every call (no optimizer "
    "step advances the cache), as on a step's first micro-batch",
)
@click.option(
    "--num-processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="GPUs of this node, one process each: >1 benchmarks the fused expert-parallel path at EP=N "
    "(benchmarks.bench_ep: T_comm, T_gemm, overlap and the serial NCCL path per op; --mode layer against "
    "NCCL all-to-all + torch._grouped_mm)",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write every result here")
@click.option("--dry-run", is_flag=True, help="print the cases and exit without touching the GPU")
def main(
    mode: str,
    models: str,
    routings: str,
    fwd_only: bool,
    precision: str,
    num_processes: int,
    json_path: str | None,
    dry_run: bool,
) -> None:
    names = _split(models)
    if precision == "mxfp8" and mode != "layer":
        raise click.BadParameter("mxfp8 is benchmarked in --mode layer only", param_hint="--precision")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise click.BadParameter(
            f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}", param_hint="--models"
        )
    routing_list = _split(routings)
    bad = [r for r in routing_list if r not in ("uniform", "skewed")]
    if bad:
        raise click.BadParameter(f"unknown routing {bad}; use uniform and/or skewed", param_hint="--routing")
    if num_processes > 1 and fwd_only:
        raise click.BadParameter("--num-processes > 1 benchmarks forward + backward only")
    if dry_run:
        for n in names:
            click.echo(
                f"{mode} {n} {asdict(MODELS[n])} routing={routing_list} fwd_only={fwd_only} precision={precision} "
                f"num_processes={num_processes}"
            )
        return
    if not torch.cuda.is_available():
        raise click.ClickException("the benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
    if num_processes > 1:
        from benchmarks import bench_ep

        bench_ep.run(num_processes, mode, names, routing_list, json_path, precision)
        return
    results = run(mode, names, routing_list, fwd_only, precision)
    props = torch.cuda.get_device_properties(0)
    click.echo(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    click.echo(format_table([r for r in results if r.mode != "gemm1"]))
    gemm1 = [r for r in results if r.mode == "gemm1"]
    if gemm1:
        click.echo("\nGEMM1 alone (ours, then its baseline; speed-up = baseline ms / ours ms):")
        for ours, base in zip(gemm1[::2], gemm1[1::2], strict=True):
            for r in (ours, base):
                click.echo(f"  {r.model} {r.routing} {r.impl}: {r.ms:.3f} ms, {r.tflops:.0f} TFLOP/s")
            click.echo(f"    speed-up {base.ms / ours.ms:.3f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
