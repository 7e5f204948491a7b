"""Sweep of GEMM1's kernel variants on one GPU against ``torch._grouped_mm`` (issue 6).

    PYTHONPATH=$PWD python3 benchmarks/sweep_gemm1.py --out gemm1_sweep.json

For DeepSeek-V3 and Qwen3-30B-A3B (uniform routing, the per-rank shapes of ``megamoe.bench``) it times,
with ``triton.testing.do_bench`` (median, L2 flushed before each repeat):

* ``torch._grouped_mm`` on rows already gathered into expert order (``h`` only, no SwiGLU);
* ``plain``: our GEMM1 kernel without the SwiGLU epilogue (row gather fused, writes ``h`` only);
* every entry of ``configs.GEMM1_VARIANTS`` (row gather fused, writes ``h`` and ``act``); the
  ``tma-store-shifted`` ones (``STORE_TMA=3``) are timed with their second, ``SMALL_ONLY`` launch (here
  a scan of the tile table: uniform routing leaves no expert below BLOCK_M rows), and their bitwise
  check covers the shifted ragged last tiles (random routing: most experts end in a ragged tile).

Each variant's ``h`` and ``act`` are compared bitwise with the default variant's (``plain``: ``h`` only);
a variant that fails to compile or run is reported and the others go on. TFLOP/s count the GEMM only
(``2 R H 2I``); ``vs mm`` is ``torch._grouped_mm`` ms / variant ms (above 1: faster). Needs only torch
and triton; finishes in well under a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import triton
from triton.testing import do_bench

from megamoe.backends.triton.configs import GEMM1_VARIANTS, gemm_config, num_programs
from megamoe.backends.triton.grouped_gemm import grouped_gemm
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.bench import MODELS, make_routing

BASELINE = "torch._grouped_mm"
PLAIN = "plain"


def _time(fn) -> float:
    return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _sweep_model(model: str, variants: list[str], device: torch.device) -> list[dict]:
    shape = MODELS[model]
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    torch.manual_seed(0)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(G, 2 * I, H, device=device, dtype=torch.bfloat16) / H**0.5
    idx, _ = make_routing(shape, "uniform", device=device)
    plan = build_routing_plan(idx, num_experts=G, block_m=gemm_config("gemm1", device)["BLOCK_M"])
    R = T * shape.topk
    valid = int(plan.expert_start_G1[-1])  # uniform routing drops nothing: valid == R
    flops = 2.0 * valid * H * 2 * I
    num_sms = num_programs(device)

    def run(name: str, h: torch.Tensor, act: torch.Tensor | None):
        cfg = gemm_config("gemm1", device, "default" if name == PLAIN else name)
        grouped_gemm(
            x,
            w1,
            h,
            plan,
            a_mode=1,
            b_kn=False,
            config=cfg,
            num_sms=num_sms,
            a_rows=plan.row_token_R,
            act=act,
        )

    rows: list[dict] = []
    x_sorted = x.index_select(0, plan.row_token_R[:valid])
    offs = plan.expert_start_G1[1:].to(torch.int32)
    w1_t = w1.transpose(-2, -1)
    h_mm = torch._grouped_mm(x_sorted, w1_t, offs=offs)
    mm_ms = _time(lambda: torch._grouped_mm(x_sorted, w1_t, offs=offs))
    rows.append({"model": model, "variant": BASELINE, "ms": mm_ms, "tflops": flops / mm_ms / 1e9})
    print(_line(rows[-1]), flush=True)

    ref: dict[str, torch.Tensor] = {}
    for name in variants:
        row = {"model": model, "variant": name, "config": {} if name == PLAIN else GEMM1_VARIANTS[name]}
        try:
            h = torch.full((R, 2 * I), float("nan"), device=device, dtype=torch.bfloat16)
            act = (
                None
                if name == PLAIN
                else torch.full((R, I), float("nan"), device=device, dtype=torch.bfloat16)
            )
            run(name, h, act)
            torch.cuda.synchronize()
            if name == "default":
                ref = {"h": h[:valid], "act": act[:valid]}
                row["h_max_abs_diff_vs_mm"] = float((h[:valid].float() - h_mm.float()).abs().max())
            if ref:
                row["h_equal"] = bool(torch.equal(h[:valid], ref["h"]))
                if act is not None:
                    row["act_equal"] = bool(torch.equal(act[:valid], ref["act"]))
            ms = _time(lambda h=h, act=act, name=name: run(name, h, act))
            row.update(ms=ms, tflops=flops / ms / 1e9, vs_mm=mm_ms / ms)
        except Exception as exc:  # one variant failing to compile or run must not stop the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _flag(value) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _line(row: dict) -> str:
    if "error" in row:
        return f"| {row['model']} | {row['variant']} | failed: {row['error'].splitlines()[0][:120]} | | | | |"
    return (
        f"| {row['model']} | {row['variant']} | {row['ms']:.3f} | {row['tflops']:.0f} | "
        f"{row.get('vs_mm', 1.0):.3f}x | {_flag(row.get('h_equal'))} | {_flag(row.get('act_equal'))} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--models", default="DeepSeek-V3,Qwen3-30B-A3B")
    parser.add_argument("--variants", default=",".join([PLAIN, *GEMM1_VARIANTS]))
    args = parser.parse_args()
    variants = args.variants.split(",")
    if "default" in variants:  # the reference of the bitwise checks runs first
        variants.remove("default")
        variants.insert(0, "default")
    unknown = [v for v in variants if v != PLAIN and v not in GEMM1_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {PLAIN}, {', '.join(GEMM1_VARIANTS)}")
    device = torch.device("cuda")
    header = "| model | variant | ms | TFLOP/s | vs mm | h == default | act == default |\n|---|---|---|---|---|---|---|"
    print(header, flush=True)
    rows: list[dict] = []
    for model in args.models.split(","):
        rows += _sweep_model(model, variants, device)
        torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}\n\n{header}")
    for row in rows:
        print(_line(row))


if __name__ == "__main__":
    main()
