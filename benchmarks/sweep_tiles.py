"""Tile-configuration sweep of the expert path's GEMMs on one GPU, against ``torch._grouped_mm``.

    PYTHONPATH=$PWD python3 benchmarks/sweep_tiles.py --out tiles.json [--ops gemm1,gemm2,dgrad1,dgrad2,wgrad]

For each model's per-rank shape (``megamoe.bench.MODELS``, uniform routing) and each op it times
``torch._grouped_mm`` on the same rows and our kernel under every candidate of :data:`CANDIDATES`, in
the interleaved rounds of ``megamoe.bench`` (so the card's clock drift falls on every candidate
alike), and compares each candidate's output bit for bit with the default's (tile shapes change
neither the order of a sum nor an epilogue's formula). The ops, as the layer runs them:

* ``gemm1``  ``h = x[rows] @ W1[e]^T``, rows gathered in the kernel; without and with the SwiGLU epilogue
* ``gemm2``  ``o = a @ W2[e]^T`` on contiguous rows
* ``dgrad2`` ``da = dy[rows] @ W2[e]``, rows gathered in the kernel
* ``dgrad1`` ``dx_rows = dh @ W1[e]`` on contiguous rows
* ``wgrad``  ``dW1[e] = dh_e^T x_e`` and ``dW2[e] = dy_e^T a_e`` (K-grouped over each expert's rows)

``vs mm`` is ``torch._grouped_mm`` ms / candidate ms (``-`` where torch refuses the layout). Needs a
CUDA GPU, torch and triton; a few minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton

from megamoe.backends.triton.configs import gemm_config, num_programs, wgrad_config
from megamoe.backends.triton.grouped_gemm import grouped_gemm
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton.wgrad import grouped_wgrad
from megamoe.bench import MODELS, _time_interleaved, make_routing

# candidate name: overrides of the op's default config (all compile for sm_90a without spills
# within 227 KB of shared memory)
CANDIDATES: dict[str, dict[str, dict]] = {
    "m_grouped": {
        "default": {},
        "group-m-4": {"GROUP_M": 4},
        "group-m-8": {"GROUP_M": 8},
        "group-m-16": {"GROUP_M": 16},
        "stages-4": {"num_stages": 4},
    },
    "wgrad": {
        "default": {},
        "group-m-4": {"GROUP_M": 4},
        "group-m-16": {"GROUP_M": 16},
        "stages-4": {"num_stages": 4},
        "k128-stages-2": {"BLOCK_K": 128, "num_stages": 2},
        "m256-n128": {"BLOCK_M": 256, "BLOCK_N": 128},
        "k32-stages-6": {"BLOCK_K": 32, "num_stages": 6},
    },
}
OPS = ("gemm1", "gemm2", "dgrad1", "dgrad2", "wgrad")


def _grouped_mm_or_none(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> Callable[[], object] | None:
    """``torch._grouped_mm(a, b, offs=offs)`` as a thunk, or None where torch refuses these layouts."""
    try:
        torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, ValueError):
        return None
    return lambda: torch._grouped_mm(a, b, offs=offs)


def _legs(op: str, model: str, device: torch.device) -> tuple[dict, dict, float]:
    """(baseline thunks, {(candidate, variant): (launch thunk, outputs)}, GEMM FLOPs by variant) of ``op``."""
    shape = MODELS[model]
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    torch.manual_seed(0)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    idx, _ = make_routing(shape, "uniform", device=device)
    plan = build_routing_plan(idx, num_experts=G, block_m=gemm_config("gemm1", device)["BLOCK_M"])
    valid, R = int(plan.expert_start_G1[-1]), T * shape.topk
    offs = plan.expert_start_G1[1:].to(torch.int32)
    rows = plan.row_token_R
    sms = num_programs(device)
    x, dy = torch.randn(T, H, **bf16), torch.randn(T, H, **bf16)
    w1, w2 = torch.randn(G, 2 * I, H, **bf16) / H**0.5, torch.randn(G, H, I, **bf16) / I**0.5
    a, dh = torch.randn(R, I, **bf16), torch.randn(R, 2 * I, **bf16)
    flops = 2.0 * valid * H * (2 * I if op in ("gemm1", "dgrad1") else I)
    legs: dict = {}
    if op == "wgrad":
        x_sorted, dy_sorted = x[rows], dy[rows]
        forms = {"dW1": (dh, x_sorted, (G, 2 * I, H)), "dW2": (dy_sorted, a, (G, H, I))}
        base = {
            f"mm {k}": _grouped_mm_or_none(p[:valid].t(), q[:valid], offs) for k, (p, q, _) in forms.items()
        }
        for name, override in CANDIDATES["wgrad"].items():
            for form, (p, q, out_shape) in forms.items():
                out = torch.zeros(out_shape, **bf16)
                config = wgrad_config(device) | override
                legs[(name, form)] = (
                    lambda p=p, q=q, out=out, config=config: grouped_wgrad(
                        p, q, out, plan, config=config, num_sms=sms
                    ),
                    (out,),
                )
        return base, legs, {"dW1": 2.0 * valid * 2 * I * H, "dW2": 2.0 * valid * H * I}
    a_op, b_op, a_mode, b_kn, n_out = {
        "gemm1": (x, w1, 1, False, 2 * I),
        "gemm2": (a, w2, 0, False, H),
        "dgrad2": (dy, w2, 1, True, I),
        "dgrad1": (dh, w1, 0, True, H),
    }[op]
    a_rows = a_op[rows[:valid]] if a_mode == 1 else a_op[:valid]
    base = {"mm": _grouped_mm_or_none(a_rows, b_op if b_kn else b_op.transpose(-2, -1), offs)}
    variants = ("none", "swiglu") if op == "gemm1" else ("none",)
    for name, override in CANDIDATES["m_grouped"].items():
        for variant in variants:
            out = torch.zeros(R, n_out, **bf16)
            act = torch.zeros(R, I, **bf16) if variant == "swiglu" else None
            config = gemm_config(op, device) | override
            kwargs = {"a_mode": a_mode, "b_kn": b_kn, "config": config, "num_sms": sms, "act": act}
            kwargs["a_rows"] = rows if a_mode == 1 else None
            legs[(name, variant)] = (
                lambda out=out, kwargs=kwargs: grouped_gemm(a_op, b_op, out, plan, **kwargs),
                (out,) if act is None else (out, act),
            )
    return base, legs, dict.fromkeys(variants, flops)


def _sweep(op: str, model: str, device: torch.device) -> list[dict]:
    base, legs, flops = _legs(op, model, device)
    timed = {k: fn for k, fn in base.items() if fn is not None} | {k: fn for k, (fn, _) in legs.items()}
    for fn, _ in legs.values():
        fn()
    torch.cuda.synchronize()
    times = dict(zip(timed, _time_interleaved([(fn, []) for fn in timed.values()]), strict=True))
    rows = []
    for key, ms in times.items():
        row = {"op": op, "model": model, "leg": key if isinstance(key, str) else "/".join(key), "ms": ms}
        if key in legs:
            variant = key[1]
            mm = times.get("mm") or times.get(f"mm {variant}")
            row |= {"tflops": flops[variant] / ms / 1e9, "vs_mm": mm / ms if mm else None}
            reference = legs[("default", variant)][1]
            row["same_bits"] = all(torch.equal(o, r) for o, r in zip(legs[key][1], reference, strict=True))
        rows.append(row)
        vs = f"{row['vs_mm']:.3f}x" if row.get("vs_mm") else "-"
        print(
            f"| {op} | {model} | {row['leg']} | {ms:.3f} | {vs} | {row.get('same_bits', '-')} |", flush=True
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args()
    unknown = [op for op in args.ops.split(",") if op not in OPS]
    if unknown:
        raise SystemExit(f"unknown ops {unknown}; known: {', '.join(OPS)}")
    device = torch.device("cuda")
    print("| op | model | leg | ms | vs mm | same bits |\n|---|---|---|---|---|---|")
    rows: list[dict] = []
    for op in args.ops.split(","):
        for model in args.models.split(","):
            rows += _sweep(op, model, device)
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
