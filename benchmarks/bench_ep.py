"""Multi-GPU benchmark of the fused expert-parallel path (``python -m benchmarks.bench --num-processes N``).

One process per GPU of one node (NCCL for the baselines, symmetric memory for ours). Each rank runs
a model's per-rank work (T tokens, top-K over ``N x G`` experts, G local experts) and times, per
fused op of the expert path:

* ``T_measured``  the op as the layer runs it;
* ``T_comm``      the same op without its math (the GEMM's K loop left out; rows still move);
* ``T_gemm``      the same op without its communication (no barrier, no push, local stores);
* ``overlap``     ``max(T_comm, T_gemm) / T_measured`` (1.0 = the shorter leg is fully hidden);
* ``serial``      the NCCL pipeline (``megamoe.backends.exchange``, the steps of megatron's all-to-all
  dispatcher) around the same GEMM, in sequence: rows gathered into send order, ``all_to_all_single``,
  sorted by expert; for a combine the inverse permutation and the all-to-all back (split sizes
  computed once outside the timing, which flatters the serial path).

Each op's sample is ``OP_CALLS_PER_SAMPLE`` back-to-back calls, enqueued while a spin kernel holds the
GPU (:func:`benchmarks.common.time_collective`), so the host's launch latency (stage 1 starts with its
routing tables, the count exchange and the layout) is not counted as device time, for either path.

``--mode layer`` times ``fused_mega_moe`` forward + backward against the NCCL all-to-all +
``torch._grouped_mm`` pipeline (the split sizes read on the host each step, as megatron's
all-to-all dispatcher does). Every time is the median of CUDA-event-timed repeats after warm-up,
and the slowest rank's median is reported; the legs of one comparison are timed in interleaved
rounds (:func:`benchmarks.common.time_collective_interleaved`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks.common import (
    MODELS,
    ModelShape,
    peak_gib,
    rank_inputs,
    time_collective,
    time_collective_interleaved,
)
from megamoe.settings import DISPATCH_MODES

_NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


TRANSPORT_NAMES = {"symm": "symmetric memory", "nccl": "NCCL all-to-all"}

OP_CALLS_PER_SAMPLE = 3
"""back-to-back calls per timed sample of one fused op (its legs and its serial path alike)."""


@dataclass(slots=True)
class StageResult:
    model: str
    routing: str
    stage: str
    comm_ms: float
    gemm_ms: float
    measured_ms: float
    serial_ms: float

    @property
    def overlap(self) -> float:
        return max(self.comm_ms, self.gemm_ms) / self.measured_ms

    @property
    def speedup(self) -> float:
        return self.serial_ms / self.measured_ms


@dataclass(slots=True)
class LayerResult:
    model: str
    routing: str
    impl: str
    ms: float
    tflops: float
    peak_gib: float


def _max_peak_gib(fn: Callable[[], object]) -> float:
    """Peak memory of ``fn`` above what was allocated before it, the largest over the ranks."""
    peak = torch.tensor([peak_gib(fn)], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def baseline_ep_layer(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, group
) -> Tensor:
    """NCCL all-to-all + ``torch._grouped_mm`` expert path with autograd (megatron's a2a dispatcher flow)."""
    from torch.distributed.nn.functional import all_to_all_single

    from megamoe.backends.exchange import TokenExchange

    E = w1.shape[0] * dist.get_world_size(group)
    ex = TokenExchange.build(topk_idx, num_experts=E, group=group)
    send = x[ex.send_tokens_S]
    recv = all_to_all_single(
        send.new_empty(sum(ex.recv_splits), x.shape[1]), send, ex.recv_splits, ex.send_splits, group
    )
    rows = recv[ex.recv_perm_R]
    offs = torch.tensor(ex.tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    o = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    source_major = o.new_zeros(o.shape).index_copy(0, ex.recv_perm_R, o)
    back = all_to_all_single(send.new_empty(send.shape), source_major, ex.send_splits, ex.recv_splits, group)
    w = topk_weights.reshape(-1)[ex.send_slots_S].unsqueeze(1).to(back.dtype)
    return x.new_zeros(x.shape).index_add(0, ex.send_tokens_S, back * w)


@dataclass(frozen=True, slots=True)
class OpLegs:
    """One fused op of the EP path as the benchmark runs it: the op itself and its legs (module docstring).

    ``variants``: ``(label, full, comm)`` of the same op measured another way, sharing its GEMM and
    serial legs. Each callable reads ``MEGAMOE_SYMM_DISPATCH`` when called.
    """

    stage: str
    full: Callable[[], object]
    comm: Callable[[], object]
    gemm: Callable[[], object]
    serial: Callable[[], object]
    variants: tuple[tuple[str, Callable[[], object], Callable[[], object]], ...] = ()

    @property
    def dispatches(self) -> bool:
        """Whether it moves rows to the experts (timed in every dispatch mode)."""
        return "dispatch" in self.stage


def op_legs(
    shape: ModelShape, routing: str, group, mode: str
) -> tuple[list[OpLegs], Callable[[], object], list[str]]:
    """The fused ops of ``mode`` on this rank's inputs at ``shape``, the (local) wgrads, and the dispatch
    modes the EP group's workspace supports (broadcast only where it was allocated for it: broadcast
    mode when it was built, the default at EP = 2).

    ``dispatch_grouped_gemm``: the ops that dispatch rows (forward stage 1, backward dy dispatch);
    ``grouped_gemm_combine``: the ops that combine rows (forward stage 2, backward dx).
    """
    from megamoe.backends.exchange import TokenExchange
    from megamoe.backends.symm import backend as fused
    from megamoe.backends.symm import launch
    from megamoe.backends.symm.backend import SymmBackend
    from megamoe.backends.symm.workspace import COUNTER_COMBINE
    from megamoe.backends.triton.combine import combine
    from megamoe.backends.triton.configs import num_programs, wgrad_config
    from megamoe.backends.triton.swiglu import swiglu_forward
    from megamoe.backends.triton.wgrad import grouped_wgrad
    from megamoe.settings import SymmSettings

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x, idx, tw, w1, w2 = rank_inputs(shape, routing, world, rank)
    E = w1.shape[0] * world
    sb = SymmBackend(SymmSettings.from_env())
    plan = sb.make_plan(idx, num_experts=E, group=group)
    h, wts = sb.stage1_forward(x, tw, w1, plan)[:2]
    ws, lay, s = plan.ws, plan.layout, plan.send
    P, H, I = ws.pool_rows, x.shape[1], w2.shape[2]
    no_tiles = torch.zeros(1, dtype=torch.int32, device="cuda")
    pool = ws.view("pool")
    a = h.new_empty(P, I)
    local_h = x.new_empty(P, H)
    dh = torch.randn_like(h)
    dy = torch.randn_like(x)
    y = torch.empty_like(x)
    da = h.new_empty(P, I)
    # the serial path is the NCCL pipeline's (megamoe.backends.exchange, megatron's all-to-all
    # dispatcher): rows permuted into send order, all-to-all, sorted by expert for the same GEMM, and
    # the inverse around the combine; only its routing metadata (host-side splits) is built once here
    ex = TokenExchange.build(idx, num_experts=E, group=group)
    R = ex.num_rows

    def gemm(op, a_rk, b, b_kn, num_tiles_1=lay.num_tiles_1, **kw):
        launch.fused_gemm(
            ws, op=op, a_RK=a_rk, b=b, b_kn=b_kn, tiles_X3=lay.tiles_X3, num_tiles_1=num_tiles_1, **kw
        )

    remote = launch.RemoteOut(lay.row_src_R, lay.row_pos_R, own_tiles_1=lay.num_local_tiles_1)
    remote_scalar = launch.RemoteOut(lay.row_src_R, lay.row_pos_R, wts.float())  # as stage1_backward

    def broadcast() -> bool:
        return ws.dispatch == "broadcast"

    def fwd1_full():
        p = sb.make_plan(idx, num_experts=E, group=group)
        sb.stage1_forward(x, tw, w1, p)

    def fwd1_start(planned: bool):
        if not planned:  # [pull staging,] the count exchange with the barrier, the layout
            return sb.exchange(plan, x, tw)
        if ws.dispatch == "pull":
            launch.stage_for_pull(ws, x, s.row_token_R, s.row_values_R(tw).float())
        launch.begin_op(ws)

    def fwd1_planned():  # the original's method: the op on a reused plan (tables and layout), barrier kept
        fwd1_start(planned=True)
        sb.dispatch_gemm1(plan, x, tw, w1)

    def fwd1_comm(planned: bool = False):
        fwd1_start(planned)
        if broadcast():  # the copies and flags, tiles that only wait
            send_weight = s.row_values_R(tw).float()
            launch.broadcast_rows(ws, x, s.row_token_R, send_weight)
            gemm("gemm1", pool, w1, False, num_tiles_1=no_tiles, out_RN=h, wait=True, local_rows=lay,
                 broadcast=(x, s.row_token_R))  # fmt: skip
            launch.join_broadcast(ws)
            return
        push = fused.rows_to_move(plan, x, tw)
        gemm("gemm1", pool, w1, False, num_tiles_1=no_tiles, out_RN=h, push=push, local_rows=lay)

    def fwd1_gemm():
        gemm("gemm1", pool, w1, False, out_RN=h)

    def fwd2_full():
        sb.stage2_forward(h, wts, w2, plan)

    def fwd2_comm():
        launch.begin_op(ws)
        gemm("gemm2", a, w2, False, remote=remote, variant="comm_only")
        launch.wait_flags(ws, "combine_ready", COUNTER_COMBINE)
        combine(ws.view("combine"), s.slot_row_S, y, topk=s.topk, weights_R=None)

    def fwd2_gemm():
        swiglu_forward(h, a, lay.expert_start_G1[-1:])
        gemm("gemm2", a, w2, False, out_RN=local_h, row_scale_R=wts.float())
        combine(local_h, s.slot_row_S, y, topk=s.topk, weights_R=None)

    def bwd2_broadcast(num_tiles_1):  # copies, dgrad tiles gathering them, the pool filled beside
        fused.begin(plan)
        sb.broadcast_dgrad(
            plan, dy, gather_pool=True, op="dgrad2", a_RK=pool, b=w2, b_kn=True, tiles_X3=lay.tiles_X3,
            num_tiles_1=num_tiles_1, out_RN=da, wait=True, local_rows=lay, broadcast=(dy, s.row_token_R),
        )  # fmt: skip

    def bwd2_full():
        if broadcast():
            return bwd2_broadcast(lay.num_tiles_1)
        d = fused.rows_to_move(plan, dy)
        fused.begin(plan, d)
        gemm("dgrad2", pool, w2, True, out_RN=da, push=d, wait=True)

    def bwd2_comm():
        if broadcast():
            return bwd2_broadcast(no_tiles)
        d = fused.rows_to_move(plan, dy)
        fused.begin(plan, d)
        gemm("dgrad2", pool, w2, True, num_tiles_1=no_tiles, out_RN=da, push=d)

    def bwd2_gemm():
        gemm("dgrad2", pool, w2, True, out_RN=da)

    def bwd1(variant: str):
        if broadcast():  # x copied to the peers, the pool filled beside the dgrad
            fused.begin(plan)
            sb.broadcast_dgrad(
                plan, x, gather_pool=True, op="dgrad1", a_RK=dh, b=w1, b_kn=True, tiles_X3=lay.tiles_X3,
                num_tiles_1=lay.num_tiles_1, remote=remote_scalar, variant=variant,
            )  # fmt: skip
        else:
            d = fused.rows_to_move(plan, x)
            fused.begin(plan, d)
            gemm("dgrad1", dh, w1, True, push=d, remote=remote_scalar, variant=variant)
        launch.wait_flags(ws, "combine_ready", COUNTER_COMBINE)
        combine(ws.view("combine"), s.slot_row_S, y, topk=s.topk, weights_R=None)

    def bwd1_full():
        bwd1("production")

    def bwd1_comm():
        bwd1(variant="comm_only")

    def bwd1_gemm():
        gemm("dgrad1", dh, w1, True, out_RN=local_h)
        combine(local_h, s.slot_row_S, y, topk=s.topk, weights_R=None)

    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    cfg, sms = wgrad_config(x.device), num_programs(x.device)

    def wgrad():  # the pool holds the last op's rows; no flag wait (broadcast mode sets no own flags)
        grouped_wgrad(dh, pool, dw1, plan.recv, config=cfg, num_sms=sms)
        grouped_wgrad(pool, a, dw2, plan.recv, config=cfg, num_sms=sms)

    dispatch_ops = [
        OpLegs(
            "fwd: dispatch + GEMM1",
            fwd1_full,
            fwd1_comm,
            fwd1_gemm,
            lambda: gemm("gemm1", ex.dispatch_tokens(x), w1, False, out_RN=h),
            (("plan reused", fwd1_planned, lambda: fwd1_comm(planned=True)),),
        ),
        OpLegs(
            "bwd dgrad: dy dispatch + GEMM2-dgrad",
            bwd2_full,
            bwd2_comm,
            bwd2_gemm,
            lambda: gemm("dgrad2", ex.dispatch_tokens(dy), w2, True, out_RN=da),
        ),
    ]
    combine_ops = [
        OpLegs(
            "fwd: GEMM2 + combine",
            fwd2_full,
            fwd2_comm,
            fwd2_gemm,
            lambda: (fwd2_gemm(), ex.combine(local_h[:R])),
        ),
        OpLegs(
            "bwd dgrad: GEMM1-dgrad + dx combine (+ x re-dispatch)",
            bwd1_full,
            bwd1_comm,
            bwd1_gemm,
            lambda: (bwd1_gemm(), ex.combine(local_h[:R]), ex.dispatch_tokens(x)),
        ),
    ]
    modes = [m for m in DISPATCH_MODES if m != "broadcast" or ws.shapes["bcast_x"][0][0]]
    return (dispatch_ops if mode == "dispatch_grouped_gemm" else combine_ops), wgrad, modes, ws


def bench_stages(name: str, shape: ModelShape, routing: str, group, mode: str) -> list[StageResult]:
    """T_comm, T_gemm, T_measured and the serial time of the fused ops of ``mode`` (:func:`op_legs`);
    with ``grouped_gemm_combine`` also the wgrads. Every op that moves rows to the experts is timed in
    every dispatch mode the workspace supports."""
    ops, wgrad, modes, ws = op_legs(shape, routing, group, mode)
    results = []
    chosen = ws.settings
    for dispatch in modes:  # one workspace, its dispatch mode switched between the legs
        ws.settings = replace(chosen, dispatch=dispatch)
        for op in ops:
            if not op.dispatches and dispatch != "push":
                continue
            label = f"{op.stage} [{dispatch}]" if op.dispatches else op.stage
            fns = [op.comm, op.gemm, op.full, op.serial] + [
                f for _, full, comm in op.variants for f in (full, comm)
            ]
            t = time_collective_interleaved(fns, calls_per_sample=OP_CALLS_PER_SAMPLE)
            results.append(StageResult(name, routing, label, t[0], t[1], t[2], t[3]))
            for i, (variant, _, _) in enumerate(op.variants):
                results.append(
                    StageResult(name, routing, f"{label}, {variant}", t[5 + 2 * i], t[1], t[4 + 2 * i], t[3])
                )
    ws.settings = chosen
    if mode == "grouped_gemm_combine":
        t_wgrad = time_collective(wgrad, calls_per_sample=OP_CALLS_PER_SAMPLE)
        results.append(
            StageResult(name, routing, "bwd wgrad: dW1 + dW2 (local)", 0.0, t_wgrad, t_wgrad, t_wgrad)
        )
    return results


LAYER_LEGS: dict[str, tuple[tuple[str, str], ...]] = {
    "bf16": (("bf16", "symm"),),
    "mxfp8": (("bf16", "symm"), ("mxfp8", "symm")),
    "fp8": (("bf16", "symm"), ("fp8", "symm"), ("fp8", "nccl")),
}
"""``--precision``'s legs of ``--mode layer``, (precision, transport) each, timed beside the NCCL pipeline:
a quantised precision beside our bf16 path; FP8 over both of its transports."""


def bench_layer(
    name: str, shape: ModelShape, routing: str, group, precision: str = "bf16"
) -> list[LayerResult]:
    """``fused_mega_moe`` forward + backward against the NCCL all-to-all + ``_grouped_mm`` pipeline, for
    each of ``precision``'s :data:`LAYER_LEGS` (quantised weights re-quantised every call)."""
    from megamoe import fused_mega_moe
    from megamoe.settings import EPSettings

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x, idx, tw, w1, w2 = rank_inputs(shape, routing, world, rank)
    leaves = [t.requires_grad_() for t in (x, tw, w1, w2)]
    dy = torch.randn_like(x)
    env = EPSettings.from_env()

    def ours(precision: str, transport: str) -> Callable[[], Tensor]:
        settings = replace(env, transport=transport)
        return lambda: fused_mega_moe(
            x, idx, tw, w1, w2, group=group, backend="triton", precision=precision, settings=settings
        )

    impls = {
        f"megamoe{'' if p == 'bf16' else ' ' + p} ({TRANSPORT_NAMES[t]})": ours(p, t)
        for p, t in LAYER_LEGS[precision]
    }
    impls["NCCL all-to-all + torch._grouped_mm"] = lambda: baseline_ep_layer(x, idx, tw, w1, w2, group)
    flops = 3 * 6 * shape.tokens * shape.topk * shape.hidden * shape.inter
    steps = [
        lambda forward=forward: torch.autograd.backward(forward(), dy, inputs=leaves)
        for forward in impls.values()
    ]
    out = []
    for impl, step, ms in zip(impls, steps, time_collective_interleaved(steps), strict=True):
        out.append(LayerResult(name, routing, impl, ms, flops / (ms * 1e-3) / 1e12, _max_peak_gib(step)))
        for leaf in leaves:
            leaf.grad = None
    return out


def format_stages(results: list[StageResult]) -> str:
    rows = [
        "| model | routing | stage | T_comm ms | T_gemm ms | T_measured ms | overlap | serial ms | speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.model} | {r.routing} | {r.stage} | {r.comm_ms:.3f} | {r.gemm_ms:.3f} | {r.measured_ms:.3f} | "
            f"{r.overlap:.1%} | {r.serial_ms:.3f} | {r.speedup:.2f}x |"
        )
    return "\n".join(rows)


def format_layers(results: list[LayerResult]) -> str:
    rows = [
        "| model | routing | impl | fwd+bwd ms | TFLOP/s per GPU | peak GiB | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {(r.model, r.routing): r.ms for r in results if r.impl.startswith("NCCL")}
    for r in results:
        rows.append(
            f"| {r.model} | {r.routing} | {r.impl} | {r.ms:.3f} | {r.tflops:.0f} | {r.peak_gib:.2f} | "
            f"{base[(r.model, r.routing)] / r.ms:.2f}x |"
        )
    return "\n".join(rows)


def _worker(
    rank: int,
    world: int,
    port: int,
    mode: str,
    models: list[str],
    routings: list[str],
    out: str | None,
    precision: str,
) -> None:
    os.environ.update(_NO_MULTICAST)
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )
    group = dist.group.WORLD
    stages: list[StageResult] = []
    layers: list[LayerResult] = []
    for name in models:
        for routing in routings:
            if mode == "layer":
                layers += bench_layer(name, MODELS[name], routing, group, precision)
            else:
                stages += bench_stages(name, MODELS[name], routing, group, mode)
            torch.cuda.empty_cache()
    if rank == 0:
        props = torch.cuda.get_device_properties(0)
        print(
            f"devices: {world} x {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}"
        )
        print(format_layers(layers) if layers else format_stages(stages), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(
                    {"stages": [asdict(r) for r in stages], "layers": [asdict(r) for r in layers]},
                    f,
                    indent=1,
                )
    dist.barrier()
    dist.destroy_process_group()


def run(
    num_processes: int,
    mode: str,
    models: list[str],
    routings: list[str],
    json_path: str | None,
    precision: str = "bf16",
) -> None:
    """Spawn one process per GPU and print the slowest rank's table (rank 0 prints)."""
    import socket

    import torch.multiprocessing as mp

    if torch.cuda.device_count() < num_processes:
        raise RuntimeError(
            f"--num-processes {num_processes} needs as many GPUs; this node has {torch.cuda.device_count()}"
        )
    os.environ.update(_NO_MULTICAST)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(
        _worker,
        args=(num_processes, port, mode, models, routings, json_path, precision),
        nprocs=num_processes,
        join=True,
    )
