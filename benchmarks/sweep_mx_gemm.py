"""Sweep of the MXFP8 GEMM tiles against the bf16 grouped GEMM on one GPU (issue 8's speed).

    python -m benchmarks.sweep_mx_gemm --out mx_sweep.json

At DeepSeek-V3's per-rank shapes (T 8192, top-8, 32 experts uniform: R = 65536 expert-sorted rows,
H 7168, I 2048) it times with ``triton.testing.do_bench`` (median ms):

* ``gemm1``: ``h = x W1^T`` (K = H = 7168, N = 2I = 4096), rows gathered through ``row_token``
  (the fused dispatch) in both kernels;
* ``gemm2``: ``o = a W2^T`` (K = I = 2048, N = H = 7168), rows already expert-sorted (TMA);
* ``wgrad``: ``dW1 = dh^T x`` (M = 2I, N = H, K = R in 32 expert segments);

each as the bf16 Triton kernel with its own config, then the MX kernel for each candidate of
:data:`GEMM_CANDIDATES` / :data:`WGRAD_CANDIDATES` (the first is the backend's default,
``megamoe.backends.triton_mx.configs``). Operands are quantised once, outside the timing. Each MX
output is compared with the default config's (``max rel`` = max |diff| / max |default|: 0 up to
fp32 summation order). A candidate that fails to compile or run is reported and the others go on.
The quantisers (x rowwise, W1 both forms, SwiGLU forward) are timed once with their defaults.
Prints a markdown table (TFLOP/s; ``bf16/MX`` = bf16 ms / MX ms, above 1: MX faster) and writes JSON.
Needs only torch and triton; about a minute on an H200 (most of it compiling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import traceback

import torch
from triton.testing import do_bench

from megamoe.backends.triton.configs import gemm_config as bf16_gemm_config
from megamoe.backends.triton.configs import num_programs
from megamoe.backends.triton.configs import wgrad_config as bf16_wgrad_config
from megamoe.backends.triton.grouped_gemm import grouped_gemm
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton.wgrad import grouped_wgrad
from megamoe.backends.triton_mx.configs import WGRAD_BLOCK_ALIGN, gemm_config, wgrad_config
from megamoe.backends.triton_mx.grouped_gemm import mx_grouped_gemm
from megamoe.backends.triton_mx.quantize_rows import quantize_rows
from megamoe.backends.triton_mx.quantize_segments import quantize_segments, segment_block_starts
from megamoe.backends.triton_mx.swiglu import swiglu_quant
from megamoe.backends.triton_mx.weights import empty_weight_mx, quantize_weight
from megamoe.backends.triton_mx.wgrad import mx_wgrad

T, TOPK, G, H, I = 8192, 8, 32, 7168, 2048

GEMM_CANDIDATES: list[dict[str, int]] = [
    {},  # the default (configs.GPU_GEMM)
    {"block_k": 64, "num_stages": 3},
    # one warpgroup a program (255 registers, 57 KB shared): two fit on an SM, and their CTA-wide
    # barriers are independent, so one's 32-deep MMA overlaps the other's scaled accumulate (Triton
    # 3.6 waits for every non-accumulating wgmma at once: no overlap inside one program)
    {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2},
    {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 6, "programs_per_sm": 2},
    {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2},
]
"""TileConfig fields replaced in the M-grouped MX GEMM's default tile (block_m stays the routing plan's
128); ``programs_per_sm`` multiplies the persistent grid (``num_sms`` programs at 1)."""
WGRAD_CANDIDATES: list[dict[str, int]] = [
    {},  # the default (configs.GPU_WGRAD)
    {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2},
    {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2},
]
"""TileConfig fields replaced in the MX wgrad's default tile; block_k / 32 must divide WGRAD_BLOCK_ALIGN."""


def _time(fn) -> float:
    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def _row(op: str, kernel: str, config: dict, flops: float, fn) -> dict:
    row = {"op": op, "kernel": kernel, "config": config}
    try:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        row["ms"] = _time(fn)
        row["tflops"] = flops / row["ms"] / 1e9 if flops else None
    except Exception as exc:  # one bad config must not stop the sweep
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        traceback.print_exc()
    return row


def _compare(row: dict, out: torch.Tensor, ref: torch.Tensor | None) -> None:
    if "error" in row or ref is None:
        return
    row["max_rel_vs_default"] = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _fmt(row: dict, bf16_ms: float | None) -> str:
    cfg = ", ".join(f"{k}={v}" for k, v in row["config"].items())
    if "error" in row:
        return f"| {row['op']} | {row['kernel']} | {cfg} | error: {row['error'][:80]} | | | |"
    ratio = f"{bf16_ms / row['ms']:.2f}" if bf16_ms and row["kernel"] != "bf16" else ""
    tf = f"{row['tflops']:.0f}" if row.get("tflops") else ""
    rel = f"{row['max_rel_vs_default']:.1e}" if "max_rel_vs_default" in row else ""
    return f"| {row['op']} | {row['kernel']} | {cfg} | {row['ms']:.3f} | {tf} | {ratio} | {rel} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="mx_sweep.json", help="JSON file for the rows")
    parser.add_argument("--device", default="cuda", help="torch device (cuda; cpu only for a dry run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    num_sms = num_programs(device)
    torch.manual_seed(0)
    # uniform top-8 over 32 experts: distinct experts per token (random scores' top-k)
    idx = torch.rand(T, G, device=device).topk(TOPK, dim=1).indices
    plan = build_routing_plan(idx, num_experts=G, block_m=gemm_config(device).block_m)
    R = T * TOPK
    print(f"default MX GEMM config: {gemm_config(device)}")
    print(f"default MX wgrad config: {wgrad_config(device)} (block align {WGRAD_BLOCK_ALIGN})")
    print(f"bf16 gemm1 config: {bf16_gemm_config('gemm1', device)}; bf16 wgrad: {bf16_wgrad_config(device)}")

    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(G, 2 * I, H, device=device, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(G, H, I, device=device, dtype=torch.bfloat16) / I**0.5
    a_sorted = torch.randn(R, I, device=device, dtype=torch.bfloat16)
    h = torch.randn(R, 2 * I, device=device, dtype=torch.bfloat16)
    dh = torch.randn(R, 2 * I, device=device, dtype=torch.bfloat16)
    qx = quantize_rows(x)
    qw1 = empty_weight_mx((G, 2 * I, H), device)
    quantize_weight(w1, qw1)
    qw2 = empty_weight_mx((G, H, I), device)
    quantize_weight(w2, qw2)
    qa = quantize_rows(a_sorted)
    rows: list[dict] = []

    def gemm_op(op, flops, bf16_fn, mx_fn, out_shape, out_dtype):
        bf16_out = torch.empty(out_shape, device=device, dtype=torch.bfloat16)
        rows.append(_row(op, "bf16", {}, flops, lambda: bf16_fn(bf16_out)))
        bf16_ms = rows[-1].get("ms")
        print(_fmt(rows[-1], bf16_ms), flush=True)
        ref = None
        for cand in GEMM_CANDIDATES:
            cfg = dataclasses.replace(gemm_config(device), **cand)
            out = torch.empty(out_shape, device=device, dtype=out_dtype)
            row = _row(op, "mx", cand or {"default": True}, flops, lambda cfg=cfg, out=out: mx_fn(out, cfg))
            if not cand and "error" not in row:
                ref = out
            _compare(row, out, ref)
            rows.append(row)
            print(_fmt(row, bf16_ms), flush=True)

    print("| op | kernel | config | ms | TFLOP/s | bf16/MX | max rel |\n|---|---|---|---|---|---|---|")
    gemm_op(
        "gemm1",
        2.0 * R * H * 2 * I,
        lambda out: grouped_gemm(
            x,
            w1,
            out,
            plan,
            a_mode=1,
            b_kn=False,
            config=bf16_gemm_config("gemm1", device),
            num_sms=num_sms,
            a_rows=plan.row_token_R,
        ),
        lambda out, cfg: mx_grouped_gemm(
            qx, qw1, out, plan, config=cfg, num_sms=num_sms, a_rows=plan.row_token_R
        ),
        (R, 2 * I),
        torch.bfloat16,
    )
    gemm_op(
        "gemm2",
        2.0 * R * I * H,
        lambda out: grouped_gemm(
            a_sorted,
            w2,
            out,
            plan,
            a_mode=0,
            b_kn=False,
            config=bf16_gemm_config("gemm2", device),
            num_sms=num_sms,
        ),
        lambda out, cfg: mx_grouped_gemm(qa, qw2, out, plan, config=cfg, num_sms=num_sms),
        (R, H),
        torch.bfloat16,
    )

    # wgrad: dW1 = dh^T x over each expert's rows (x gathered into expert order for the bf16 kernel)
    flops = 2.0 * R * 2 * I * H
    x_sorted = x.index_select(0, plan.row_token_R.clamp(min=0))
    dw_bf16 = torch.empty(G, 2 * I, H, device=device, dtype=torch.bfloat16)
    rows.append(
        _row(
            "wgrad",
            "bf16",
            {},
            flops,
            lambda: grouped_wgrad(
                dh, x_sorted, dw_bf16, plan, config=bf16_wgrad_config(device), num_sms=num_sms
            ),
        )
    )
    bf16_ms = rows[-1].get("ms")
    print(_fmt(rows[-1], bf16_ms), flush=True)
    block_start = segment_block_starts(plan.expert_start_G1, align=WGRAD_BLOCK_ALIGN)
    num_blocks = -(-R // 32) + G * WGRAD_BLOCK_ALIGN
    qp = quantize_segments(dh, plan.expert_start_G1, block_start, num_blocks)
    qq = quantize_segments(x, plan.expert_start_G1, block_start, num_blocks, index_R=plan.row_token_R)
    ref = None
    for cand in WGRAD_CANDIDATES:
        cfg = dataclasses.replace(wgrad_config(device), **cand)
        out = torch.empty(G, 2 * I, H, device=device, dtype=torch.bfloat16)
        row = _row(
            "wgrad",
            "mx",
            cand or {"default": True},
            flops,
            lambda cfg=cfg, out=out: mx_wgrad(
                qp, qq, out, block_start, config=cfg, num_sms=num_sms, block_align=WGRAD_BLOCK_ALIGN
            ),
        )
        if not cand and "error" not in row:
            ref = out
        _compare(row, out, ref)
        rows.append(row)
        print(_fmt(row, bf16_ms), flush=True)

    # quantisers and the SwiGLU pass (memory-bound: GB/s of bf16 read + E4M3 written)
    valid = plan.expert_start_G1[-1:]
    qw1_t = empty_weight_mx((G, H, 2 * I), device)
    for name, nbytes, fn in [
        ("quantize_rows(x)", 3 * T * H, lambda: quantize_rows(x, qx)),
        ("quantize W1 rowwise", 3 * w1.numel(), lambda: quantize_weight(w1, qw1)),
        ("quantize W1 transposed", 3 * w1.numel(), lambda: quantize_weight(w1.transpose(1, 2), qw1_t)),
        ("swiglu_quant(h)", 5 * R * I, lambda: swiglu_quant(h, valid)),
        (
            "quantize_segments(x, gathered)",
            3 * R * H,
            lambda: quantize_segments(
                x, plan.expert_start_G1, block_start, num_blocks, index_R=plan.row_token_R
            ),
        ),
    ]:
        row = _row(name, "mx", {}, 0.0, fn)
        if "ms" in row:
            row["gb_per_s"] = nbytes / row["ms"] / 1e6
            print(f"| {name} | mx | | {row['ms']:.3f} | {row['gb_per_s']:.0f} GB/s | | |", flush=True)
        else:
            print(_fmt(row, None), flush=True)
        rows.append(row)

    with open(args.out, "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows},
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
