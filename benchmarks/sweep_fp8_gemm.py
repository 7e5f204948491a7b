"""Sweep of the blockwise-FP8 GEMM tiles against the bf16 grouped GEMM on one GPU.

    python -m benchmarks.sweep_fp8_gemm --out fp8_sweep.json

At DeepSeek-V3's per-rank shapes (T 8192, top-8, 32 experts uniform: R = 65536 expert-sorted rows,
H 7168, I 2048) it times with ``triton.testing.do_bench`` (median ms):

* ``gemm1``: ``h = x W1^T`` (K = H, N = 2I), rows gathered through ``row_token`` in both kernels;
* ``gemm2``: ``o = a W2^T`` (K = I, N = H), rows already expert-sorted (TMA);
* ``wgrad``: ``dW1 = dh^T x`` (M = 2I, N = H, K = R in 32 expert segments);

each as the bf16 Triton kernel with its own config, then the Triton FP8 kernel for each candidate of
:data:`GEMM_CANDIDATES` / :data:`WGRAD_CANDIDATES` (the first is its default,
:mod:`megamoe.backends.triton_fp8.configs`), then, on Hopper, the warp-specialised Gluon GEMM the
backend runs there (``fp8-wgmma``; for gemm1 the quantised rows gathered first, that gather timed with
it); then the quantisers (the along-R one in each tile of :data:`SEGMENT_TILES`), the quantised
rows' gather and two copies, the rate the passes' bytes would move at (alone with
``--passes-only``). Operands are quantised once, outside the timing. ``max rel`` compares each output with the default config's (0 up to fp32
summation order). A candidate that fails to compile or run is reported and the others go on.
Prints a markdown table (``bf16/FP8`` = bf16 ms / FP8 ms, above 1: FP8 faster) and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from benchmarks.sweep_mx_gemm import TOPK, G, H, I, T, _compare, _fmt, _row
from megamoe.backends.triton.configs import gemm_config as bf16_gemm_config
from megamoe.backends.triton.configs import num_programs
from megamoe.backends.triton.configs import wgrad_config as bf16_wgrad_config
from megamoe.backends.triton.grouped_gemm import grouped_gemm
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton.wgrad import grouped_wgrad
from megamoe.backends.triton_fp8.configs import GPU_WGMMA, GPU_WGMMA_WGRAD, gemm_config, wgrad_config
from megamoe.backends.triton_fp8.grouped_gemm import fp8_grouped_gemm
from megamoe.backends.triton_fp8.quantize import (
    SEGMENT_TILE,
    empty_weight,
    gather_rows,
    quantize_rows,
    quantize_segments,
    quantize_weight,
    quantize_weight_both,
    segment_block_starts,
)
from megamoe.backends.triton_fp8.swiglu import swiglu_quant
from megamoe.backends.triton_fp8.wgrad import fp8_wgrad

try:  # Gluon with Hopper's warpgroup MMA
    from megamoe.backends.triton_fp8 import wgmma_gemm, wgmma_wgrad
except ImportError:
    wgmma_gemm = wgmma_wgrad = None

GEMM_CANDIDATES: list[dict[str, int]] = [
    {},  # the default (configs.GPU_GEMM_GATHER for gemm1, GPU_GEMM_TMA for gemm2)
    {"block_n": 128, "num_warps": 8, "num_stages": 4, "programs_per_sm": 1},
    {"block_n": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 2, "programs_per_sm": 3},
    {"block_n": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 3},
    {"block_n": 32, "num_warps": 4, "num_stages": 2, "programs_per_sm": 4},
]
"""TileConfig fields replaced in the M-grouped FP8 GEMM's default tile (block_m stays the routing
plan's 128, block_k 128); ``programs_per_sm`` multiplies the persistent grid."""
WGRAD_CANDIDATES: list[dict[str, int]] = [
    {},  # the default (configs.GPU_WGRAD)
    {"block_n": 128, "num_warps": 8, "num_stages": 4, "programs_per_sm": 1},
    {"block_n": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2},
    {"block_n": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 3},
]
"""TileConfig fields replaced in the FP8 wgrad's default tile."""
SEGMENT_TILES: list[tuple[int, int]] = [SEGMENT_TILE, (16, 4), (32, 2), (32, 8), (64, 4), (64, 8), (128, 8)]
"""(columns, warps) of the along-R quantiser's programs, the first its default."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fp8_sweep.json", help="JSON file for the rows")
    parser.add_argument("--passes-only", action="store_true", help="time the quantisers and gathers only")
    args = parser.parse_args()
    device = torch.device("cuda")
    num_sms = num_programs(device)
    torch.manual_seed(0)
    idx = torch.rand(T, G, device=device).topk(TOPK, dim=1).indices
    plan = build_routing_plan(idx, num_experts=G, block_m=gemm_config(device, gather=True).block_m)
    R = T * TOPK
    for name, config in (
        ("GEMM, gathered rows", gemm_config(device, gather=True)),
        ("GEMM, rows by TMA", gemm_config(device, gather=False)),
        ("wgrad", wgrad_config(device)),
    ):
        print(f"default FP8 {name} config: {config}")
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(G, 2 * I, H, device=device, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(G, H, I, device=device, dtype=torch.bfloat16) / I**0.5
    a_sorted = torch.randn(R, I, device=device, dtype=torch.bfloat16)
    h = torch.randn(R, 2 * I, device=device, dtype=torch.bfloat16)
    dh = torch.randn(R, 2 * I, device=device, dtype=torch.bfloat16)
    qx, qa = quantize_rows(x), quantize_rows(a_sorted)
    qw1, qw2 = empty_weight((G, 2 * I, H), device), empty_weight((G, H, I), device)
    quantize_weight(w1, qw1)
    quantize_weight(w2, qw2)
    rows: list[dict] = []

    def sweep(
        op, flops, bf16_fn, fp8_fn, out_shape, default, candidates, wgmma_fn=None, wgmma_config=GPU_WGMMA
    ):
        if args.passes_only:
            return
        bf16_out = torch.empty(out_shape, device=device, dtype=torch.bfloat16)
        rows.append(_row(op, "bf16", {}, flops, lambda: bf16_fn(bf16_out)))
        bf16_ms = rows[-1].get("ms")
        print(_fmt(rows[-1], bf16_ms), flush=True)
        ref = None
        for cand in candidates:
            cfg = dataclasses.replace(default, **cand)
            out = torch.empty(out_shape, device=device, dtype=torch.bfloat16)
            row = _row(op, "fp8", cand or {"default": True}, flops, lambda cfg=cfg, out=out: fp8_fn(out, cfg))
            if not cand and "error" not in row:
                ref = out
            _compare(row, out, ref)
            rows.append(row)
            print(_fmt(row, bf16_ms), flush=True)
        if wgmma_fn is not None and wgmma_gemm is not None and wgmma_gemm.supported(device):
            out = torch.empty(out_shape, device=device, dtype=torch.bfloat16)
            row = _row(op, "fp8-wgmma", dataclasses.asdict(wgmma_config), flops, lambda: wgmma_fn(out))
            _compare(row, out, ref)
            rows.append(row)
            print(_fmt(row, bf16_ms), flush=True)

    print("| op | kernel | config | ms | TFLOP/s | bf16/FP8 | max rel |\n|---|---|---|---|---|---|---|")
    bf16 = {op: bf16_gemm_config(op, device) for op in ("gemm1", "gemm2")}
    sweep(
        "gemm1",
        2.0 * R * H * 2 * I,
        lambda out: grouped_gemm(
            x,
            w1,
            out,
            plan,
            a_mode=1,
            b_kn=False,
            config=bf16["gemm1"],
            num_sms=num_sms,
            a_rows=plan.row_token_R,
        ),
        lambda out, cfg: fp8_grouped_gemm(
            qx, qw1, out, plan, config=cfg, num_sms=num_sms, a_rows=plan.row_token_R
        ),
        (R, 2 * I),
        gemm_config(device, gather=True),
        GEMM_CANDIDATES,
        lambda out: wgmma_gemm.wgmma_fp8_grouped_gemm(
            gather_rows(qx, plan.row_token_R), qw1, out, plan, config=GPU_WGMMA, num_sms=num_sms
        ),
    )
    sweep(
        "gemm2",
        2.0 * R * I * H,
        lambda out: grouped_gemm(
            a_sorted, w2, out, plan, a_mode=0, b_kn=False, config=bf16["gemm2"], num_sms=num_sms
        ),
        lambda out, cfg: fp8_grouped_gemm(qa, qw2, out, plan, config=cfg, num_sms=num_sms),
        (R, H),
        gemm_config(device, gather=False),
        GEMM_CANDIDATES,
        lambda out: wgmma_gemm.wgmma_fp8_grouped_gemm(qa, qw2, out, plan, config=GPU_WGMMA, num_sms=num_sms),
    )
    x_sorted = x.index_select(0, plan.row_token_R.clamp(min=0))
    block_start = segment_block_starts(plan.expert_start_G1)
    num_blocks = -(-R // 128) + G
    qp = quantize_segments(dh, plan.expert_start_G1, block_start, num_blocks)
    qq = quantize_segments(x, plan.expert_start_G1, block_start, num_blocks, index_R=plan.row_token_R)
    sweep(
        "wgrad",
        2.0 * R * 2 * I * H,
        lambda out: grouped_wgrad(
            dh, x_sorted, out.view(G, 2 * I, H), plan, config=bf16_wgrad_config(device), num_sms=num_sms
        ),
        lambda out, cfg: fp8_wgrad(qp, qq, out.view(G, 2 * I, H), block_start, config=cfg, num_sms=num_sms),
        (G, 2 * I, H),
        wgrad_config(device),
        WGRAD_CANDIDATES,
        lambda out: wgmma_wgrad.wgmma_fp8_wgrad(
            qp, qq, out.view(G, 2 * I, H), block_start, config=GPU_WGMMA_WGRAD, num_sms=num_sms
        ),
        GPU_WGMMA_WGRAD,
    )
    valid = plan.expert_start_G1[-1:]
    qw1_t = empty_weight((G, H, 2 * I), device)
    dh_copy, qw1_copy = torch.empty_like(dh), torch.empty_like(qw1.data.view(torch.uint8))
    for name, nbytes, fn in [
        ("quantize_rows(x)", 3 * T * H, lambda: quantize_rows(x)),
        ("quantize W1", 3 * w1.numel(), lambda: quantize_weight(w1, qw1)),
        ("quantize W1 transposed", 3 * w1.numel(), lambda: quantize_weight(w1.transpose(1, 2), qw1_t)),
        ("quantize W1, both forms", 4 * w1.numel(), lambda: quantize_weight_both(w1, qw1, qw1_t)),
        ("gather_rows(q(x))", 2 * R * H, lambda: gather_rows(qx, plan.row_token_R)),
        ("quantize_rows(dh)", 3 * R * 2 * I, lambda: quantize_rows(dh, valid_rows_1=valid)),
        *(
            (
                f"quantize_segments(dh), {tile[0]} columns x {tile[1]} warps",
                3 * R * 2 * I,
                lambda tile=tile: quantize_segments(
                    dh, plan.expert_start_G1, block_start, num_blocks, tile=tile
                ),
            )
            for tile in SEGMENT_TILES
        ),
        ("swiglu_quant(h)", 5 * R * I, lambda: swiglu_quant(h, valid)),
        ("a copy of dh (bf16): the card's memory rate", 4 * R * 2 * I, lambda: dh_copy.copy_(dh)),
        ("a copy of q(W1)'s E4M3 bytes", 2 * w1.numel(), lambda: qw1_copy.copy_(qw1.data.view(torch.uint8))),
        *(
            (
                f"quantize_segments(x, gathered), {tile[0]} columns x {tile[1]} warps",
                3 * R * H,
                lambda tile=tile: quantize_segments(
                    x, plan.expert_start_G1, block_start, num_blocks, index_R=plan.row_token_R, tile=tile
                ),
            )
            for tile in SEGMENT_TILES
        ),
    ]:
        row = _row(name, "fp8", {}, 0.0, fn)
        if "ms" in row:
            row["gb_per_s"] = nbytes / row["ms"] / 1e6
            print(f"| {name} | fp8 | | {row['ms']:.3f} | {row['gb_per_s']:.0f} GB/s | | |", flush=True)
        else:
            print(_fmt(row, None), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
