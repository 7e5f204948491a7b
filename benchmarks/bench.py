"""Benchmark of the expert path on one GPU: MegaMoE's Triton backend against the torchtitan-style pipeline.

    python -m benchmarks.bench --mode dispatch_grouped_gemm|grouped_gemm_combine|layer \\
        --models DeepSeek-V3,Qwen3-30B-A3B,Qwen3-235B-A22B [--routing uniform,skewed] [--fwd-only] \\
        [--baseline torch,sonic]

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

``--mode layer`` can time more peers in the same rounds (``--baseline torch,sonic``: SonicMoE when it
imports, :mod:`benchmarks.sonic`), and prints a second table: the SNR of ``y`` and of every gradient of
each implementation against the float32 reference backend (:mod:`benchmarks.layer_accuracy`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import click
import torch
from torch import Tensor

from benchmarks import layer_accuracy, sonic
from benchmarks.common import MODELS, ModelShape, make_routing, peak_gib, time_interleaved

MODES = ("dispatch_grouped_gemm", "grouped_gemm_combine", "layer")
QUANTIZED = ("mxfp8", "fp8")
"""precisions timed against our bf16 path (``--mode layer``)."""
LABELS = {"megamoe": "ours", "mxfp8": "mxfp8", "baseline": "base", "sonic": "sonic"}
"""impl -> its name in the printed tables, in column order."""


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


BASELINES = {"torch": ("baseline", baseline_layer), "sonic": ("sonic", sonic.sonic_layer)}
"""``--baseline`` name -> (the impl its results carry, its layer function); the torch pipeline's impl
is ``baseline`` in every mode, as in the JSON of every earlier run."""


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


def _inputs(shape: ModelShape, routing: str, device: torch.device) -> tuple[Tensor, ...]:
    """``x [T, H], topk_idx [T, K], topk_weights [T, K], w1 [G, 2I, H], w2 [G, H, I]``, seeded, bf16 but
    the float32 routing weights; the four float ones are autograd leaves."""
    torch.manual_seed(0)
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    dt = torch.bfloat16
    x = torch.randn(T, H, device=device, dtype=dt).requires_grad_()
    w1 = (torch.randn(G, 2 * I, H, device=device, dtype=dt) / H**0.5).requires_grad_()
    w2 = (torch.randn(G, H, I, device=device, dtype=dt) / I**0.5).requires_grad_()
    idx, tw = make_routing(shape, routing, device=device)
    return x, idx, tw.requires_grad_(), w1, w2


def _cases(
    mode: str,
    inputs: tuple[Tensor, ...],
    precision: str = "bf16",
    baselines: tuple[str, ...] = ("torch",),
    cached_weights: bool = False,
):
    """Yield ``(impl, forward_fn, leaves)`` for ours and each baseline, on one set of :func:`_inputs`.

    With a quantised ``precision`` ours is that precision's Triton backend and the baseline our own
    bf16 Triton path (the FP8 targets are relative to it), so the speed-up column is bf16 ms / ours
    ms; ``fp8`` also times the MXFP8 backend beside them. Each quantised call starts with an optimizer
    step's generation advance (each weight form quantised once per call and kept for its backward, as
    in training without gradient accumulation), unless ``cached_weights`` (the caller advanced once:
    every form served, as on a step's later micro-batches). In layer mode, every peer of ``baselines``
    follows ours, on the same leaves.
    """
    from megamoe import advance_weight_generation, dispatch_grouped_gemm, fused_mega_moe, grouped_gemm_combine

    x, idx, tw, w1, w2 = inputs
    T = x.shape[0]
    if precision in QUANTIZED:

        def quantised(p: str) -> Tensor:
            if not cached_weights:
                advance_weight_generation()
            return fused_mega_moe(x, idx, tw, w1, w2, backend="triton", precision=p)

        for impl, p in (("megamoe", precision), *((("mxfp8", "mxfp8"),) if precision == "fp8" else ())):
            yield impl, lambda p=p: quantised(p), [x, tw, w1, w2]
        yield "baseline", lambda: fused_mega_moe(x, idx, tw, w1, w2, backend="triton"), [x, tw, w1, w2]
    elif mode == "layer":
        yield "megamoe", lambda: fused_mega_moe(x, idx, tw, w1, w2, backend="triton"), [x, tw, w1, w2]
        for b in baselines:
            impl, layer = BASELINES[b]
            yield impl, lambda layer=layer: layer(x, idx, tw, w1, w2), [x, tw, w1, w2]
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
    idx, tw = make_routing(shape, routing, device=device)
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
            (lambda: ops.gemm1_forward(x, w1, tw.view(-1), r.row_slot_R, shape.topk, *r.kernel_tables()), []),
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


def _time_cases(
    mode: str, name: str, shape: ModelShape, routing: str, cases: list, fwd_only: bool
) -> list[Result]:
    """Each phase's cases timed in interleaved rounds, after one untimed forward and backward of
    each: SonicMoE autotunes its GEMMs on a shape's first call (minutes, :mod:`benchmarks.sonic`),
    so every implementation is warm before the first round; how long each warm-up took goes to stderr."""
    rows = shape.tokens * shape.topk
    phases: dict[str, list] = {"fwd": []} if fwd_only else {"fwd": [], "fwd+bwd": []}
    for impl, forward, leaves in cases:
        start = time.perf_counter()
        out = forward()
        grad_out = torch.randn_like(out)
        if not fwd_only:
            torch.autograd.backward(out, grad_out, inputs=leaves)
        del out
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.synchronize()
        click.echo(f"{name} {routing}: {LABELS[impl]} warm in {time.perf_counter() - start:.1f} s", err=True)

        def fwd(forward=forward):
            with torch.no_grad():
                forward()

        def fwd_bwd(forward=forward, leaves=leaves, grad_out=grad_out):
            torch.autograd.backward(forward(), grad_out, inputs=leaves)

        phases["fwd"].append((fwd, leaves))
        if not fwd_only:
            phases["fwd+bwd"].append((fwd_bwd, leaves))
    every_leaf = [leaf for _, _, leaves in cases for leaf in leaves]
    results = []
    for phase, timed in phases.items():
        mult = 1 if phase == "fwd" else 3
        times = time_interleaved(timed)
        for (impl, _, _), (fn, _), ms in zip(cases, timed, times, strict=True):
            tflops = mult * _flops(mode, shape, rows) / (ms * 1e-3) / 1e12
            for leaf in every_leaf:  # no .grad left by the timed rounds: each peak counts its gradients
                leaf.grad = None
            results.append(Result(name, routing, mode, phase, impl, ms, tflops, peak_gib(fn)))
    return results


def run(
    mode: str,
    shapes: dict[str, ModelShape],
    routings: list[str],
    fwd_only: bool,
    precision: str = "bf16",
    baselines: tuple[str, ...] = ("torch",),
    cached_weights: bool = False,
) -> tuple[list[Result], list[layer_accuracy.Accuracy]]:
    """Timings of every (shape, routing) and, in layer mode, every implementation's accuracy."""
    device = torch.device("cuda")
    results: list[Result] = []
    accuracy: list[layer_accuracy.Accuracy] = []
    for name, shape in shapes.items():
        rows = shape.tokens * shape.topk
        for routing in routings:
            inputs = _inputs(shape, routing, device)
            cases = list(_cases(mode, inputs, precision, baselines, cached_weights))
            results += _time_cases(mode, name, shape, routing, cases, fwd_only)
            if mode == "layer":
                emulated = {"megamoe": precision, "mxfp8": "mxfp8"} if precision in QUANTIZED else {}
                for impl, against, snr in layer_accuracy.measure(cases, inputs, emulated=emulated):
                    accuracy.append(layer_accuracy.Accuracy(name, routing, impl, snr, against))
            if mode == "dispatch_grouped_gemm" and precision == "bf16":
                for impl, ms in _gemm1_alone(shape, routing, device):
                    tflops = 4 * rows * shape.hidden * shape.inter / (ms * 1e-3) / 1e12
                    results.append(Result(name, routing, "gemm1", "fwd", impl, ms, tflops, float("nan")))
            del cases, inputs
            torch.cuda.empty_cache()
    return results, accuracy


def format_table(results: list[Result]) -> str:
    """One line per (model, routing, mode, phase): ours, then per baseline its ms, TFLOP/s and
    speed-up (its ms / ours), then the peak memory of each; a baseline missing on a line shows —."""
    keyed: dict[tuple, dict[str, Result]] = {}
    for r in results:
        keyed.setdefault((r.model, r.routing, r.mode, r.phase), {})[r.impl] = r
    peers = [impl for impl in LABELS if impl != "megamoe" and any(impl in by for by in keyed.values())]
    header = ["model", "routing", "mode", "phase", "ours ms", "ours TFLOP/s"]
    for impl in peers:
        header += [f"{LABELS[impl]} {col}" for col in ("ms", "TFLOP/s", "speed-up")]
    header += ["ours GiB", *(f"{LABELS[impl]} GiB" for impl in peers)]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, by_impl in keyed.items():
        ours = by_impl["megamoe"]
        cells = [*key, f"{ours.ms:.3f}", f"{ours.tflops:.0f}"]
        for impl in peers:
            peer = by_impl.get(impl)
            cells += (
                [f"{peer.ms:.3f}", f"{peer.tflops:.0f}", f"{peer.ms / ours.ms:.3f}x"] if peer else ["—"] * 3
            )
        cells += [
            f"{ours.peak_gib:.2f}",
            *(f"{by_impl[i].peak_gib:.2f}" if i in by_impl else "—" for i in peers),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _baselines(value: str, mode: str, precision: str, num_processes: int) -> list[str]:
    """The ``--baseline`` list, checked (order kept, repeats dropped)."""
    names = list(dict.fromkeys(_split(value)))
    bad = [b for b in names if b not in BASELINES]
    if bad or not names:
        raise click.BadParameter(
            f"unknown baseline(s) {bad}; use a comma list of {', '.join(BASELINES)}", param_hint="--baseline"
        )
    if names != ["torch"] and (mode != "layer" or precision != "bf16" or num_processes > 1):
        raise click.BadParameter(
            "peers other than torch are compared in --mode layer at --precision bf16 on one GPU only",
            param_hint="--baseline",
        )
    return names


def _unavailable(baselines: list[str]) -> dict[str, str]:
    """``{baseline: why}`` for each listed peer that cannot run here."""
    if "sonic" in baselines and (reason := sonic.import_error()):
        return {"sonic": f"sonicmoe not importable: {reason}"}
    return {}


def _write_json(
    path: str, results: list[Result], accuracy: list, skipped: dict[str, str], cached_weights: bool
) -> None:
    props = torch.cuda.get_device_properties(0)
    record = {
        "device": f"{props.name}, {props.multi_processor_count} SMs",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        "quantised_weights": "cached" if cached_weights else "quantised once per call",
        "skipped": skipped,
        "results": [asdict(r) for r in results],
        "accuracy": [asdict(a) for a in accuracy],
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


@click.command(help=__doc__)
@click.option("--mode", type=click.Choice(MODES), default="layer", show_default=True)
@click.option("--models", default=",".join(MODELS), show_default=True, help="comma-separated model names")
@click.option(
    "--routing", "routings", default="uniform,skewed", show_default=True, help="uniform and/or skewed"
)
@click.option(
    "--baseline",
    "baselines",
    default="torch",
    show_default=True,
    help="comma-separated peers timed against ours in the same rounds: torch (the _grouped_mm pipeline) "
    "and, in --mode layer at bf16 on one GPU, sonic (SonicMoE; skipped with its reason when it does "
    "not import)",
)
@click.option("--fwd-only", is_flag=True, help="time the forward only")
@click.option(
    "--precision",
    type=click.Choice(["bf16", *QUANTIZED]),
    default="bf16",
    show_default=True,
    help="expert GEMM precision; mxfp8 and fp8 (layer mode) time that Triton backend against our own "
    "bf16 Triton path in the same run (speed-up = bf16 ms / ours ms; fp8 also times mxfp8 beside them; "
    "with --num-processes > 1: mxfp8 over symmetric memory, fp8 over symmetric memory and over NCCL "
    "all-to-all, beside bf16 and the NCCL pipeline), and on one GPU report the SNR "
    "against float32 and against the precision's exact emulation. Each call starts an optimizer step: its "
    "forward quantises the weights and its backward reuses them, as in training without gradient "
    "accumulation, unless --cached-weights",
)
@click.option(
    "--cached-weights",
    is_flag=True,
    help="with --precision mxfp8 or fp8, on one GPU: serve the quantised weights from the weight cache, "
    "as on an optimizer step's later micro-batches (the generation is advanced once, so each form is "
    "quantised on its first call only)",
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
    baselines: str,
    fwd_only: bool,
    precision: str,
    cached_weights: bool,
    num_processes: int,
    json_path: str | None,
    dry_run: bool,
) -> None:
    names = _split(models)
    if cached_weights and precision not in QUANTIZED:
        raise click.BadParameter(
            f"the weight cache holds quantised weights: use --precision {' or '.join(QUANTIZED)}",
            param_hint="--cached-weights",
        )
    if precision in QUANTIZED and mode != "layer":
        raise click.BadParameter(f"{precision} is benchmarked in --mode layer only", param_hint="--precision")
    if cached_weights and num_processes > 1:
        raise click.BadParameter(
            "--cached-weights is benchmarked on one GPU only", param_hint="--cached-weights"
        )
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
    baseline_list = _baselines(baselines, mode, precision, num_processes)
    skipped = _unavailable(baseline_list)
    for peer, reason in skipped.items():
        click.echo(f"{peer}: skipped ({reason})")
        baseline_list.remove(peer)
    if dry_run:
        for n in names:
            click.echo(
                f"{mode} {n} {asdict(MODELS[n])} routing={routing_list} fwd_only={fwd_only} precision={precision} "
                f"cached_weights={cached_weights} num_processes={num_processes} baselines={baseline_list}"
            )
        return
    if not torch.cuda.is_available():
        raise click.ClickException("the benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
    if num_processes > 1:
        from benchmarks import bench_ep

        bench_ep.run(num_processes, mode, names, routing_list, json_path, precision)
        return
    shapes = {n: MODELS[n] for n in names}
    if cached_weights:
        from megamoe import advance_weight_generation

        advance_weight_generation()  # from now on an unchanged weight's forms are served, not re-quantised
    results, accuracy = run(
        mode, shapes, routing_list, fwd_only, precision, tuple(baseline_list), cached_weights
    )
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
    if accuracy:
        click.echo(f"\n{layer_accuracy.CAPTION}")
        click.echo(layer_accuracy.format_table(accuracy, LABELS))
    if json_path:
        _write_json(json_path, results, accuracy, skipped, cached_weights)


if __name__ == "__main__":
    main()
