"""Tile-configuration sweep of GEMM1 (row gather fused) on one GPU against ``torch._grouped_mm``.

    PYTHONPATH=$PWD python3 benchmarks/sweep_gemm1.py --out gemm1_sweep.json

For each model's per-rank shape (``megamoe.bench.MODELS``, uniform routing) it times
``torch._grouped_mm`` on rows gathered beforehand and our GEMM1 kernel under every candidate of
:data:`CANDIDATES`, without the epilogue (``h`` only) and with the SwiGLU epilogue (``h`` and
``act``), all in the interleaved rounds of ``megamoe.bench`` (so the card's clock drift falls on
every candidate alike). Each candidate's outputs are compared bit for bit with the default's: the
tile shape changes neither the K order of the sum nor the epilogue's formula. ``vs mm`` is
``torch._grouped_mm`` ms / candidate ms. Needs a CUDA GPU, torch and triton; about a minute on an H200.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from megamoe.backends.triton.configs import gemm_config, num_programs
from megamoe.backends.triton.grouped_gemm import grouped_gemm
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.bench import MODELS, _time_interleaved, make_routing

# name: overrides of gemm_config("gemm1") (all compile for sm_90a without spills within 227 KB of
# shared memory; tests/megamoe/triton/sm90_compile.py's helper checks them)
CANDIDATES: dict[str, dict] = {
    "default": {},
    "stages-4": {"num_stages": 4},
    "k32-stages-6": {"BLOCK_K": 32, "num_stages": 6},
    "k32-stages-7": {"BLOCK_K": 32, "num_stages": 7},
    "group-m-4": {"GROUP_M": 4},
    "group-m-16": {"GROUP_M": 16},
    "n128-stages-4": {"BLOCK_N": 128, "num_stages": 4},
}


def _sweep(model: str, device: torch.device) -> list[dict]:
    shape = MODELS[model]
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    torch.manual_seed(0)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(G, 2 * I, H, device=device, dtype=torch.bfloat16) / H**0.5
    idx, _ = make_routing(shape, "uniform", device=device)
    plan = build_routing_plan(idx, num_experts=G, block_m=gemm_config("gemm1", device)["BLOCK_M"])
    valid = int(plan.expert_start_G1[-1])
    flops = 2.0 * valid * H * 2 * I
    R = T * shape.topk
    outputs = {
        (name, swiglu): (x.new_zeros(R, 2 * I), x.new_zeros(R, I) if swiglu else None)
        for name in CANDIDATES
        for swiglu in (False, True)
    }

    def launch(name: str, swiglu: bool) -> None:
        h, act = outputs[(name, swiglu)]
        config = gemm_config("gemm1", device) | CANDIDATES[name]
        grouped_gemm(
            x, w1, h, plan, a_mode=1, b_kn=False, config=config, num_sms=num_programs(device),
            a_rows=plan.row_token_R, act=act,
        )  # fmt: skip

    x_sorted = x.index_select(0, plan.row_token_R[:valid])
    offs = plan.expert_start_G1[1:].to(torch.int32)
    w1_t = w1.transpose(-2, -1)
    legs = {("torch._grouped_mm", False): lambda: torch._grouped_mm(x_sorted, w1_t, offs=offs)}
    legs |= {key: (lambda key=key: launch(*key)) for key in outputs}
    for key, fn in legs.items():
        if key in outputs:
            fn()
    torch.cuda.synchronize()
    times = dict(zip(legs, _time_interleaved([(fn, []) for fn in legs.values()]), strict=True))
    mm_ms = times[("torch._grouped_mm", False)]
    rows = []
    for (name, swiglu), ms in times.items():
        row = {"model": model, "candidate": name, "epilogue": "swiglu" if swiglu else "none", "ms": ms}
        row |= {"tflops": flops / ms / 1e9, "vs_mm": mm_ms / ms}
        if (name, swiglu) in outputs:
            h, act = outputs[(name, swiglu)]
            h0, act0 = outputs[("default", swiglu)]
            row["same_bits"] = bool(torch.equal(h[:valid], h0[:valid])) and (
                act is None or bool(torch.equal(act[:valid], act0[:valid]))
            )
        rows.append(row)
        print(
            f"| {model} | {name} | {row['epilogue']} | {ms:.3f} | {row['tflops']:.0f} | {row['vs_mm']:.3f}x | "
            f"{row.get('same_bits', '-')} |",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    device = torch.device("cuda")
    print(
        "| model | candidate | epilogue | ms | TFLOP/s | vs mm | same bits |\n|---|---|---|---|---|---|---|"
    )
    rows: list[dict] = []
    for model in args.models.split(","):
        rows += _sweep(model, device)
        torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
