"""Where the side gather's cost beside a dgrad GEMM comes from, sample by sample, on one GPU.

    python -m benchmarks.profile_side_gather [--samples 100] [--json out.json] [--layer]

At DeepSeek-V3's per-rank shape it times the dgrad GEMMs (``dgrad1``: ``dh @ W1``; ``dgrad2``: the
dy-gathering ``dy[rows] @ W2``) ``--samples`` times alone and with each variant of :data:`VARIANTS`
beside them on a side stream (one CUDA-event pair per sample, the L2 flushed before each, the legs in
interleaved rounds). The variants change one thing of the backward's row gather at a time: how its
row blocks are shared out (a fixed share per program, as an earlier ``side_gather`` did, or a
device counter, as its register copy does now), its pace (at once, or spread by the global timer over a fraction of
the GEMM's time), its cache hints, its bytes (a scatter that reads each token once), its loads or its
stores alone, no memory work at all (an empty kernel; a spin), or no row through registers (``tma``:
``side_gather``'s TMA kernel, which it uses on Hopper, timeline not recorded). Every program records its
multiprocessor (``%smid``), start, end and clock cycles, so a slow sample can be matched to the
placement (``doubled``: multiprocessors that got two or more of its programs, where the GEMM's program
then no longer fits until one ends) and the SM clock read beside the GEMM.

``--layer`` also times the whole one-GPU layer forward + backward (``fused_mega_moe``, DeepSeek-V3,
uniform) with each side gather of :data:`LAYER_GATHERS` swapped in (today's, on Hopper by the TMA unit;
the register copy with a counter; the fixed share), in interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from benchmarks.common import MODELS, make_routing, time_interleaved
from benchmarks.paced_writes import globaltimer_ns
from megamoe.backends.triton import side_gather, tma_rows
from megamoe.backends.triton.configs import gemm_config, num_programs
from megamoe.backends.triton.grouped_gemm import grouped_gemm
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton.side_gather import BLOCK_H, BLOCK_R, NUM_WARPS, copy_rows_streaming

FIXED, COUNTER, PACED, SCATTER, EMPTY, LOADS, STORES, SPIN, TMA = range(9)
"""the modes of :func:`_traced_gather_kernel`; TMA: ``tma_rows``' kernel instead (no timeline)"""
_COUNTER, _PACED, _SCATTER, _EMPTY = (tl.constexpr(m) for m in (COUNTER, PACED, SCATTER, EMPTY))
_LOADS, _STORES, _SPIN = (tl.constexpr(m) for m in (LOADS, STORES, SPIN))  # FIXED: the kernel's else
VARIANTS = {
    "fixed-stride": (FIXED, 0.0, "default", ""),
    "counter": (COUNTER, 0.0, "default", ""),
    "paced-80": (PACED, 0.8, "default", ""),
    "ld.cg": (FIXED, 0.0, ".cg", ""),
    "ld.cg st.cs": (FIXED, 0.0, ".cg", ".cs"),
    "ld.cg st.cg": (FIXED, 0.0, ".cg", ".cg"),
    "ld.cv st.cs": (FIXED, 0.0, ".cv", ".cs"),
    "scatter": (SCATTER, 0.0, "", ""),
    "empty": (EMPTY, 0.0, "", ""),
    "loads only": (LOADS, 0.0, "", ""),
    "stores only": (STORES, 0.0, "", ""),
    "spin-80": (SPIN, 0.8, "", ""),
    "tma": (TMA, 0.0, "", ""),
}
"""gather variant: the kernel's MODE, the fraction of the GEMM's median time alone a paced gather (or a
spin) spans, the loads' and stores' cache modifiers ("default": side_gather's streaming copy, evict-first
hints)"""
ROUNDS = 5
SCATTER_T = 4  # tokens per step of the scatter: 8 would need 72 registers, over what fits beside a GEMM


@triton.jit
def _clock(x):
    """The multiprocessor's cycle counter: its ticks over the global timer's nanoseconds are its clock."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _sm_and_time(x):
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
    return sm, globaltimer_ns(x)


@triton.jit
def _copy_block(
    src_ptr, index_ptr, out_ptr, block, R, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    LOAD_CM: tl.constexpr, STORE_CM: tl.constexpr,
):  # fmt: skip
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    src_row = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    if LOAD_CM == "default":
        copy_rows_streaming(src_ptr + src_row * H, out_ptr + rows.to(tl.int64) * H, row_ok, H, BLOCK_H)
    else:
        from_rows, to_rows = src_ptr + src_row * H, out_ptr + rows.to(tl.int64) * H
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = row_ok[:, None] & (cols < H)[None, :]
            v = tl.load(from_rows[:, None] + cols[None, :], mask=mask, cache_modifier=LOAD_CM)
            tl.store(to_rows[:, None] + cols[None, :], v, mask=mask, cache_modifier=STORE_CM)


@triton.jit
def _traced_gather_kernel(
    src_ptr, index_ptr, out_ptr, R, H, num_programs, counters_ptr, interval_ns, trace_ptr, slot_row_ptr,
    T, MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, LOAD_CM: tl.constexpr,
    STORE_CM: tl.constexpr, K: tl.constexpr, SCATTER_T: tl.constexpr,
):  # fmt: skip
    """``out[r] = src[index[r]]`` in blocks of ``BLOCK_R`` rows. ``MODE`` FIXED: program p copies blocks p,
    p + P, ...; COUNTER: blocks from a device counter (the last program out resets it); PACED: as FIXED,
    its j-th block not before ``j * interval_ns`` after its start; SCATTER: each token's row read once and
    stored at its K slots' rows (``slot_row``, -1 for a dropped slot, which no wgrad reads); EMPTY:
    nothing (what the side stream's fork and join cost); LOADS and STORES: FIXED's loads alone and its
    stores alone; SPIN: no memory work for ``interval_ns``. Records (sm, start, end, cycles between)."""
    pid = tl.program_id(0)
    sm, start = _sm_and_time(pid)
    start_clock = _clock(pid)
    blocks = tl.cdiv(R, BLOCK_R)
    if MODE == _COUNTER:
        block = tl.atomic_add(counters_ptr, 1)
        while block < blocks:
            _copy_block(src_ptr, index_ptr, out_ptr, block, R, H, BLOCK_R, BLOCK_H, LOAD_CM, STORE_CM)
            block = tl.atomic_add(counters_ptr, 1)
        if tl.atomic_add(counters_ptr + 1, 1) == num_programs - 1:
            tl.store(counters_ptr + tl.arange(0, 2), tl.zeros((2,), tl.int32))
    elif MODE == _EMPTY:
        pass
    elif MODE == _SPIN:  # to read the clock beside the GEMM
        _, now = _sm_and_time(pid)
        while now < start + interval_ns:
            _, now = _sm_and_time(pid)
    elif (MODE == _LOADS) or (MODE == _STORES):  # noqa: SIM109 (no tuple membership in Triton)
        # the loads kept alive by one maximum stored per program, in bf16 (32 registers)
        acc = tl.zeros((BLOCK_R, BLOCK_H), src_ptr.dtype.element_ty)
        for block in range(pid, blocks, num_programs):
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            row_ok = rows < R
            src_row = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                mask = row_ok[:, None] & (cols < H)[None, :]
                if MODE == _LOADS:
                    v = tl.load(src_ptr + src_row[:, None] * H + cols[None, :], mask=mask)
                    acc = tl.maximum(acc, v).to(src_ptr.dtype.element_ty)
                else:
                    out = out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :]
                    tl.store(out, tl.zeros((BLOCK_R, BLOCK_H), out_ptr.dtype.element_ty), mask=mask)
        if MODE == _LOADS:
            tl.store(out_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))
    elif MODE == _SCATTER:
        for t0 in range(pid * SCATTER_T, T, num_programs * SCATTER_T):
            tokens = t0 + tl.arange(0, SCATTER_T)
            ok = tokens < T
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                v = tl.load(src_ptr + tokens.to(tl.int64)[:, None] * H + cols[None, :], mask=ok[:, None])
                for k in tl.static_range(K):
                    row = tl.load(slot_row_ptr + tokens * K + k, mask=ok, other=-1).to(tl.int64)
                    tl.store(out_ptr + row[:, None] * H + cols[None, :], v, mask=(row >= 0)[:, None])
    else:
        due = start
        for block in range(pid, blocks, num_programs):
            if MODE == _PACED:
                _, now = _sm_and_time(pid)
                while now < due:
                    _, now = _sm_and_time(pid)
                due += interval_ns
            _copy_block(src_ptr, index_ptr, out_ptr, block, R, H, BLOCK_R, BLOCK_H, LOAD_CM, STORE_CM)
    _, end = _sm_and_time(pid)
    end_clock = _clock(pid)
    tl.store(trace_ptr + pid * 4, sm.to(tl.int64))
    tl.store(trace_ptr + pid * 4 + 1, start)
    tl.store(trace_ptr + pid * 4 + 2, end)
    tl.store(trace_ptr + pid * 4 + 3, end_clock - start_clock)


def _inputs(device: torch.device) -> dict:
    shape = MODELS["DeepSeek-V3"]
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    torch.manual_seed(0)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    idx, _ = make_routing(shape, "uniform", device=device)
    plan = build_routing_plan(idx, num_experts=G, block_m=gemm_config("dgrad1", device).block_m)
    R = T * shape.topk
    return {
        "plan": plan,
        "x": torch.randn(T, H, **bf16),
        "dy": torch.randn(T, H, **bf16),
        "w1": torch.randn(G, 2 * I, H, **bf16) / H**0.5,
        "w2": torch.randn(G, H, I, **bf16) / I**0.5,
        "dh": torch.randn(R, 2 * I, **bf16),
        "dx_rows": torch.empty(R, H, **bf16),
        "da": torch.empty(R, I, **bf16),
        "gathered": torch.empty(R, H, **bf16),
    }


def _gemm(op: str, t: dict, sms: int):
    plan, device = t["plan"], t["x"].device
    if op == "dgrad1":
        cfg = gemm_config("dgrad1", device)
        return lambda: grouped_gemm(
            t["dh"], t["w1"], t["dx_rows"], plan, a_mode=0, b_kn=True, config=cfg, num_sms=sms
        )
    cfg = gemm_config("dgrad2", device)
    return lambda: grouped_gemm(
        t["dy"], t["w2"], t["da"], plan, a_mode=1, b_kn=True, config=cfg, num_sms=sms, a_rows=plan.row_token_R
    )


def _profile(op: str, variant: str | None, t: dict, samples: int, alone_ms: float = 0.0) -> dict:
    """Per-sample ms of the GEMM with the gather ``variant`` beside it (None: alone), and the placements."""
    device, sms = t["x"].device, num_programs(t["x"].device)
    gemm = _gemm(op, t, sms)
    src = t["x"] if op == "dgrad1" else t["dy"]
    index, out = t["plan"].row_token_R, t["gathered"]
    out.zero_()  # so that a variant's rows are checked, not an earlier one's
    mode, span, load_cm, store_cm = VARIANTS[variant] if variant else (0, 0.0, "default", "")
    per_program = 1 if mode == SPIN else triton.cdiv(triton.cdiv(index.numel(), BLOCK_R), sms)
    interval_ns = int(span * alone_ms * 1e6 / per_program)
    counters = torch.zeros(2, dtype=torch.int32, device=device)
    trace = torch.zeros(samples, sms, 4, dtype=torch.int64, device=device)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    times = []
    for i in range(-3, samples):  # three warm-up calls
        flush.zero_()
        begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(main)  # the fork point, before the GEMM, as RowGather records it
        begin.record()
        gemm()
        if variant is not None and mode == TMA:
            with torch.cuda.stream(side):
                counters.zero_()
                tma_rows.tma_gather_rows(src, index, out, counters, sms)
            main.wait_stream(side)
        elif variant is not None:
            with torch.cuda.stream(side):
                _traced_gather_kernel[(sms,)](
                    src, index, out, index.numel(), src.shape[1], sms, counters, interval_ns, trace[max(i, 0)],
                    t["plan"].slot_row_S, src.shape[0], MODE=mode, BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H,
                    LOAD_CM=load_cm, STORE_CM=store_cm, K=t["plan"].topk, SCATTER_T=SCATTER_T, num_warps=NUM_WARPS,
                )  # fmt: skip
            main.wait_stream(side)
        finish.record()
        if i >= 0:
            times.append((begin, finish))
    torch.cuda.synchronize()
    ms = [b.elapsed_time(f) for b, f in times]
    result = {"op": op, "gather": variant or "none", "ms": ms}
    if variant is not None:
        valid = int(t["plan"].expert_start_G1[-1])
        result["rows_ok"] = mode in (EMPTY, LOADS, STORES, SPIN) or bool(
            torch.equal(out[:valid], src[index[:valid].long()])
        )
        if mode == TMA:
            return result
        placements = trace.cpu()
        doubled = []
        for s in range(samples):
            sm_ids = placements[s, :, 0].tolist()
            doubled.append(sum(1 for sm in set(sm_ids) if sm_ids.count(sm) > 1))
        result["doubled"] = doubled
        span_ms = (placements[:, :, 2].max(dim=1).values - placements[:, :, 1].min(dim=1).values) / 1e6
        ns = (placements[:, :, 2] - placements[:, :, 1]).clamp(min=1)
        busy = ns > 20_000  # programs that ran at least 20 us: their clock is a reading
        clocks = placements[:, :, 3][busy].double() / ns[busy].double() * 1e3
        result["sm_mhz"] = [clocks.median().item()] if busy.any() else []
        result["gather_span_ms"] = span_ms.tolist()
    return result


def _summary(r: dict) -> str:
    ms = sorted(r["ms"])
    q = statistics.quantiles(ms, n=10)
    cells = [r["op"], r["gather"], *(f"{v:.3f}" for v in (ms[0], q[0], statistics.median(ms), q[-1], ms[-1]))]
    cells.append(f"{statistics.mean(ms):.3f}")
    cells.append(str(sum(1 for d in r["doubled"] if d)) if "doubled" in r else "-")
    cells.append(f"{statistics.median(r['gather_span_ms']):.3f}" if "gather_span_ms" in r else "-")
    cells.append(str(r["rows_ok"]) if "rows_ok" in r else "-")
    cells.append(f"{statistics.median(r['sm_mhz']):.0f}" if r.get("sm_mhz") else "-")
    return "| " + " | ".join(cells) + " |"


def _fixed_stride_gather_rows(src_TH: torch.Tensor, index_R: torch.Tensor, out_RH: torch.Tensor) -> None:
    """``side_gather.gather_rows`` as it was before the counter: program p copies blocks p, p + P, ..."""
    R, H = out_RH.shape
    if R == 0 or H == 0:
        return
    grid = min(num_programs(src_TH.device), triton.cdiv(R, BLOCK_R))
    trace = torch.empty(grid, 4, dtype=torch.int64, device=src_TH.device)
    _traced_gather_kernel[(grid,)](
        src_TH, index_R, out_RH, R, H, grid, None, 0, trace, None, 0, MODE=FIXED, BLOCK_R=BLOCK_R,
        BLOCK_H=BLOCK_H, LOAD_CM="default", STORE_CM="", K=1, SCATTER_T=SCATTER_T, num_warps=NUM_WARPS,
    )  # fmt: skip


LAYER_GATHERS = {
    "gather_rows (TMA on Hopper)": side_gather.gather_rows,
    "register copy, counter": side_gather.register_gather_rows,
    "register copy, fixed share": _fixed_stride_gather_rows,
}


def _layer_ab(device: torch.device) -> dict[str, float]:
    """Median ms of the layer forward + backward with each of :data:`LAYER_GATHERS` as the side gather."""
    from megamoe import fused_mega_moe

    shape = MODELS["DeepSeek-V3"]
    T, H, I, G = shape.tokens, shape.hidden, shape.inter, shape.experts
    torch.manual_seed(0)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16).requires_grad_()
    w1 = (torch.randn(G, 2 * I, H, device=device, dtype=torch.bfloat16) / H**0.5).requires_grad_()
    w2 = (torch.randn(G, H, I, device=device, dtype=torch.bfloat16) / I**0.5).requires_grad_()
    idx, tw = make_routing(shape, "uniform", device=device)
    tw = tw.requires_grad_()
    dy = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    today = side_gather.gather_rows

    def step(gather) -> None:
        side_gather.gather_rows = gather
        try:
            fused_mega_moe(x, idx, tw, w1, w2, backend="triton").backward(dy)
        finally:
            side_gather.gather_rows = today

    grads = [x, tw, w1, w2]
    cases = [(lambda g=g: step(g), grads) for g in LAYER_GATHERS.values()]
    return dict(zip(LAYER_GATHERS, time_interleaved(cases), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--json", help="write every sample there")
    parser.add_argument("--layer", action="store_true", help="also the layer with each of LAYER_GATHERS")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; known: {', '.join(VARIANTS)}")
    device = torch.device("cuda")
    t = _inputs(device)
    print(
        "| op | gather | min ms | p10 | median | p90 | max | mean | samples with a doubled SM | "
        "gather span ms (median) | rows right | SM MHz (median) |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    results = []
    for op in ("dgrad1", "dgrad2"):
        pace_ms = statistics.median(_profile(op, None, t, 20)["ms"])  # the pace's reference, untimed
        legs: dict[str | None, dict] = {}
        for _ in range(ROUNDS):  # interleaved, so the card's clock drift falls on every leg alike
            for variant in (None, *variants):
                part = _profile(op, variant, t, args.samples // ROUNDS, pace_ms)
                if variant not in legs:
                    legs[variant] = part
                else:
                    for key in ("ms", "doubled", "gather_span_ms", "sm_mhz"):
                        if key in part:
                            legs[variant][key] += part[key]
                    if "rows_ok" in part:
                        legs[variant]["rows_ok"] &= part["rows_ok"]
        for leg in legs.values():
            results.append(leg)
            print(_summary(leg), flush=True)
    layer = None
    if args.layer:
        del t
        torch.cuda.empty_cache()
        layer = _layer_ab(device)
        print(
            "layer fwd+bwd (DeepSeek-V3, uniform): " + ", ".join(f"{k} {v:.3f} ms" for k, v in layer.items())
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results, "layer": layer}, f)


if __name__ == "__main__":
    main()
