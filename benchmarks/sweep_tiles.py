"""Tile-configuration sweep of the expert path's GEMMs on one GPU, against ``torch._grouped_mm``.

    python -m benchmarks.sweep_tiles --out tiles.json [--ops gemm1,gemm2,dgrad1,dgrad2,wgrad]

For each model's per-rank shape (``benchmarks.common.MODELS``, uniform routing) and each op it times
``torch._grouped_mm`` on the same rows and our kernel under every candidate of :data:`CANDIDATES`, in
the interleaved rounds of ``benchmarks.bench`` (so the card's clock drift falls on every candidate
alike), and compares each candidate's output bit for bit with the default's (tile shapes change
neither the order of a sum nor an epilogue's formula). The ops, as the layer runs them:

* ``gemm1``  ``h = x[rows] @ W1[e]^T``, rows gathered in the kernel; without and with the SwiGLU epilogue
* ``gemm2``  ``o = a @ W2[e]^T`` on contiguous rows
* ``dgrad2`` ``da = dy[rows] @ W2[e]``, rows gathered in the kernel
* ``dgrad1`` ``dx_rows = dh @ W1[e]`` on contiguous rows
* ``wgrad``  ``dW1[e] = dh_e^T x_e`` and ``dW2[e] = dy_e^T a_e`` (K-grouped over each expert's rows)

``vs mm`` is ``torch._grouped_mm`` ms / candidate ms (``-`` where torch refuses the layout).

``--beside gather,inbound`` also times every M-grouped leg (ours and ``torch._grouped_mm``) with
memory traffic running beside it on a side stream, as EP = 2 runs these GEMMs (the wgrad legs ignore
it; ``slowdown`` is the leg's ms over its own ms alone):

* ``gather``  the backward's transient row gather (``side_gather.RowGather`` of ``x[row_token]``, the
  wgrad's TMA-fed operand; on Hopper by the TMA unit), which runs beside both dgrads on
  one GPU and, as the pool gather of broadcast mode, beside them at EP > 1;
* ``inbound`` the bytes a peer's stores and copies bring into this GPU's memory during the op at EP = 2
  (:data:`INBOUND_AT_EP2`), written at an even pace over 90 % of the default candidate's time alone
  (``benchmarks/paced_writes.py``; ``--inbound-scale`` times as many): what the traffic landing here
  costs the GEMM, without NVLink.

``--once`` launches every leg once with nothing beside it and times nothing, for a profiler
(``ncu -k regex:_grouped_gemm_kernel ...``; the legs are printed in launch order). Needs a CUDA GPU,
torch and triton; a few minutes on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch
import triton

from benchmarks.common import MODELS, make_routing, time_interleaved
from benchmarks.paced_writes import PacedWrites
from megamoe.backends.triton.configs import gemm_config, num_programs, wgrad_config
from megamoe.backends.triton.grouped_gemm import grouped_gemm
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton.side_gather import RowGather
from megamoe.backends.triton.wgrad import grouped_wgrad

# candidate name: TileConfig fields replaced in the op's default config (all compile for sm_90a
# without spills within 227 KB of shared memory)
CANDIDATES: dict[str, dict[str, dict[str, int]]] = {
    "m_grouped": {
        "default": {},
        "group-m-4": {"group_m": 4},
        "group-m-8": {"group_m": 8},
        "group-m-16": {"group_m": 16},
        "group-m-32": {"group_m": 32},
        "stages-4": {"num_stages": 4},
    },
    "wgrad": {
        "default": {},
        "group-m-4": {"group_m": 4},
        "group-m-16": {"group_m": 16},
        "stages-4": {"num_stages": 4},
        "k128-stages-2": {"block_k": 128, "num_stages": 2},
        "m256-n128": {"block_m": 256, "block_n": 128},
        "k32-stages-6": {"block_k": 32, "num_stages": 6},
    },
}
OPS = ("gemm1", "gemm2", "dgrad1", "dgrad2", "wgrad")
BESIDE = ("none", "gather", "inbound")
INBOUND_AT_EP2 = {
    # bytes landing here during the op at EP = 2, broadcast mode, uniform routing (half of the rows
    # routed from each rank are the peer's): ``x_copy`` the peer's copy of its x or dy [T, H];
    # ``half_rows`` the peer's stores of the output rows it computed for this rank's tokens [R/2, H]
    "gemm1": ("x_copy",),
    "dgrad2": ("x_copy",),
    "gemm2": ("half_rows",),
    "dgrad1": ("half_rows", "x_copy"),
}
PACE_FRACTION = 0.9
"""the paced writes end at this fraction of the GEMM's time alone, so they never outlast it"""


def _grouped_mm_or_none(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> Callable[[], object] | None:
    """``torch._grouped_mm(a, b, offs=offs)`` as a thunk, or None where torch refuses these layouts."""
    try:
        torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, ValueError):
        return None
    return lambda: torch._grouped_mm(a, b, offs=offs)


def _legs(op: str, model: str, device: torch.device) -> tuple[dict, dict, dict, dict]:
    """(baseline thunks, {(candidate, variant): (launch thunk, outputs)}, GEMM FLOPs by variant, what the
    traffic beside needs: the gathered rows' source and index, the inbound bytes at EP = 2) of ``op``."""
    shape = MODELS[model]
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    torch.manual_seed(0)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    idx, _ = make_routing(shape, "uniform", device=device)
    plan = build_routing_plan(idx, num_experts=G, block_m=gemm_config("gemm1", device).block_m)
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
                config = dataclasses.replace(wgrad_config(device), **override)
                legs[(name, form)] = (
                    lambda p=p, q=q, out=out, config=config: grouped_wgrad(
                        p, q, out, plan, config=config, num_sms=sms
                    ),
                    (out,),
                )
        return base, legs, {"dW1": 2.0 * valid * 2 * I * H, "dW2": 2.0 * valid * H * I}, {}
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
            config = dataclasses.replace(gemm_config(op, device), **override)
            kwargs = {"a_mode": a_mode, "b_kn": b_kn, "config": config, "num_sms": sms, "act": act}
            kwargs["a_rows"] = rows if a_mode == 1 else None
            legs[(name, variant)] = (
                lambda out=out, kwargs=kwargs: grouped_gemm(a_op, b_op, out, plan, **kwargs),
                (out,) if act is None else (out, act),
            )
    sizes = {"x_copy": x.numel() * x.element_size(), "half_rows": valid // 2 * H * x.element_size()}
    traffic = {"src": x, "index": rows, "inbound_bytes": sum(sizes[k] for k in INBOUND_AT_EP2[op])}
    return base, legs, dict.fromkeys(variants, flops), traffic


def _with_gather(fn: Callable[[], object], src: torch.Tensor, index: torch.Tensor) -> Callable[[], None]:
    """``fn`` with the backward's row gather beside it, in the backward's order of calls."""

    def run() -> None:
        gather = RowGather(src, index)
        fn()
        gather.start()
        gather.rows()

    return run


def _with_paced_writes(fn: Callable[[], object], writes: PacedWrites) -> Callable[[], None]:
    """``fn`` with ``writes`` launched right after it on a side stream, joined before returning."""
    side = torch.cuda.Stream()

    def run() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        fn()
        with torch.cuda.stream(side):
            writes.launch()
        main.wait_stream(side)

    return run


def _beside_legs(alone: dict, beside: list[str], traffic: dict, inbound_scale: float = 1.0) -> dict:
    """Every leg of ``alone`` again, keyed ``(leg, kind)``, with each kind of traffic of ``beside`` next to it."""
    if not traffic:
        return {}
    legs = {}
    if "gather" in beside:
        legs |= {
            (key, "gather"): _with_gather(fn, traffic["src"], traffic["index"]) for key, fn in alone.items()
        }
    if "inbound" in beside:
        from triton.testing import do_bench

        alone_ms = do_bench(alone[("default", "none")], warmup=5, rep=50, return_mode="median")
        nbytes = int(inbound_scale * traffic["inbound_bytes"])
        writes = PacedWrites(nbytes, PACE_FRACTION * alone_ms / 1e3, traffic["src"].device)
        legs |= {(key, "inbound"): _with_paced_writes(fn, writes) for key, fn in alone.items()}
        legs[("paced writes", "alone")] = writes.launch  # their pace, with nothing beside them
    return legs


def _leg_name(key: str | tuple[str, str]) -> str:
    return "/".join(key) if isinstance(key, tuple) else key


def _launch_once(op: str, model: str, device: torch.device) -> None:
    """``--once``: every leg of ``op`` launched once, in the printed order, nothing timed."""
    base, legs, _, _ = _legs(op, model, device)
    for key, fn in [(k, f) for k, f in base.items() if f is not None] + [
        (k, f) for k, (f, _) in legs.items()
    ]:
        print(f"launch {op} {model} {_leg_name(key)}", flush=True)
        fn()
        torch.cuda.synchronize()


def _sweep(op: str, model: str, device: torch.device, beside: list[str], inbound_scale: float) -> list[dict]:
    base, legs, flops, traffic = _legs(op, model, device)
    alone = {k: fn for k, fn in base.items() if fn is not None} | {k: fn for k, (fn, _) in legs.items()}
    for fn, _ in legs.values():
        fn()
    torch.cuda.synchronize()
    cases = [(key, "none", fn) for key, fn in alone.items()]
    cases += [
        (key, kind, fn) for (key, kind), fn in _beside_legs(alone, beside, traffic, inbound_scale).items()
    ]
    samples = time_interleaved([(fn, []) for _, _, fn in cases])
    times = {(key, kind): ms for (key, kind, _), ms in zip(cases, samples, strict=True)}
    rows = []
    for (key, kind), ms in times.items():
        row = {"op": op, "model": model, "leg": _leg_name(key), "beside": kind, "ms": ms}
        if key in legs:
            variant = key[1]
            mm = times.get(("mm", kind)) or times.get((f"mm {variant}", kind))
            row |= {"tflops": flops[variant] / ms / 1e9, "vs_mm": mm / ms if mm else None}
            reference = legs[("default", variant)][1]
            row["same_bits"] = all(torch.equal(o, r) for o, r in zip(legs[key][1], reference, strict=True))
        if (key, "none") in times and kind != "none":
            row["slowdown"] = ms / times[(key, "none")]
        rows.append(row)
        vs = f"{row['vs_mm']:.3f}x" if row.get("vs_mm") else "-"
        slow = f"{row['slowdown']:.3f}x" if "slowdown" in row else "-"
        print(
            f"| {op} | {model} | {row['leg']} | {kind} | {ms:.3f} | {vs} | {slow} | {row.get('same_bits', '-')} |",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file for the results (needed unless --once)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument(
        "--beside", default="none", help=f"traffic beside the M-grouped legs, any of {', '.join(BESIDE)}"
    )
    parser.add_argument(
        "--inbound-scale",
        type=float,
        default=1.0,
        help="times the EP = 2 inbound bytes written beside (inbound)",
    )
    parser.add_argument("--once", action="store_true", help="launch every leg once, time nothing (profilers)")
    args = parser.parse_args()
    ops, beside = args.ops.split(","), args.beside.split(",")
    unknown = [op for op in ops if op not in OPS] + [b for b in beside if b not in BESIDE]
    if unknown:
        raise SystemExit(
            f"unknown ops or --beside values {unknown}; ops: {', '.join(OPS)}; beside: {', '.join(BESIDE)}"
        )
    if not args.once and not args.out:
        raise SystemExit("--out FILE is needed to write the results (or --once to only launch the legs)")
    device = torch.device("cuda")
    if args.once:
        for op in ops:
            for model in args.models.split(","):
                _launch_once(op, model, device)
        return
    print(
        "| op | model | leg | beside | ms | vs mm | slowdown | same bits |\n|---|---|---|---|---|---|---|---|"
    )
    rows: list[dict] = []
    for op in ops:
        for model in args.models.split(","):
            rows += _sweep(op, model, device, beside, args.inbound_scale)
            torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "beside": beside,
        "inbound_scale": args.inbound_scale,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
