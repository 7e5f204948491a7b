"""Where the forward dispatch + GEMM1 op of the fused multi-GPU path spends its time (issue 7).

    python -m benchmarks.sweep_symm_dispatch --num-processes 2 [--out sweep.json]

``python -m benchmarks.bench --mode dispatch_grouped_gemm`` times the whole op; this splits it, at the
DeepSeek-V3 per-rank shape (T 8192, top-8, 32 local experts per rank, H 7168, I 2048), uniform
routing, one process per GPU, slowest rank's median of 20 samples of 3 back-to-back calls:

* ``prologue``: the routing sort, the count exchange (barrier) and the layout, no kernel of the op;
* ``kernel``: the fused comm + GEMM1 launch alone (after an epoch barrier; tables reused), with its
  knobs swept one at a time from the defaults: ``MEGAMOE_SYMM_COMM_PROGRAMS``,
  ``MEGAMOE_SYMM_TAIL``, ``MEGAMOE_SYMM_FLAT_WAIT``, and this rank's own rows read from ``x``
  (``local A``, the default) or copied into the pool like the peers' rows;
* ``comm only``: the same launch with no GEMM tiles; ``GEMM only``: no push, no wait;
* in broadcast mode (the default at EP = 2, else ``MEGAMOE_SYMM_DISPATCH=broadcast``): the broadcast
  kernel (copy engines move each rank's ``x`` to every peer, GEMM1 gathers rows from the copies) and
  its copies alone;

then the timeline of one kernel on rank 0 in the environment's dispatch mode (set
``MEGAMOE_SYMM_DISPATCH=push`` for the push kernel's at EP = 2), from ``MEGAMOE_SYMM_TRACE=1`` (the
GPU's global timer in every program): when the comm programs are done, when the GEMM programs run
out of fixed-stride tiles, who takes the counter tiles, when the last program ends. With
``--gpu-events``, rank 0 also profiles every fused op of the EP path and its GEMM-only leg
(``benchmarks.bench_ep.op_legs``; torch.profiler, three back-to-back calls each): per kernel or copy its
stream, calls and mean time, and the op's span, which shows where an op's time over its GEMM goes
(copies on the copy engines or SMs, side kernels, small kernels before and after).

Prints a markdown table and writes JSON. About a minute on 2 x H200, most of it compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KNOBS = (
    ("defaults", {}),
    ("comm programs 16", {"MEGAMOE_SYMM_COMM_PROGRAMS": "16"}),
    ("comm programs 24", {"MEGAMOE_SYMM_COMM_PROGRAMS": "24"}),
    ("comm programs 64", {"MEGAMOE_SYMM_COMM_PROGRAMS": "64"}),
    ("tail 0 %", {"MEGAMOE_SYMM_TAIL": "0"}),
    ("tail 10 %", {"MEGAMOE_SYMM_TAIL": "10"}),
    ("tail 50 %", {"MEGAMOE_SYMM_TAIL": "50"}),
    ("every tile from the counter", {"MEGAMOE_SYMM_FLAT_WAIT": "0"}),
)


def _legs(world: int) -> list[tuple[str, float]]:
    from benchmarks.common import MODELS, rank_inputs, time_collective
    from megamoe.backends.symm import launch
    from megamoe.backends.symm.backend import SymmBackend
    from megamoe.settings import SymmSettings

    x, idx, tw, w1, _ = rank_inputs(MODELS["DeepSeek-V3"], "uniform", world, dist.get_rank())
    sb = SymmBackend(SymmSettings.from_env())
    E = w1.shape[0] * world
    plan = sb.make_plan(idx, num_experts=E, group=dist.group.WORLD)
    h = sb.stage1_forward(x, tw, w1, plan)[0]
    ws, lay = plan.ws, plan.layout
    pool = ws.view("pool")
    no_tiles = torch.zeros(1, dtype=torch.int32, device="cuda")

    def prologue():
        p = sb.make_plan(idx, num_experts=E, group=dist.group.WORLD)
        sb.exchange(p, x, tw)

    def kernel(local_a: bool = True, tiles: torch.Tensor | None = None, push: bool = True):
        launch.begin_op(ws)
        launch.fused_gemm(
            ws, op="gemm1", a_RK=pool, b=w1, b_kn=False, tiles_X3=lay.tiles_X3,
            num_tiles_1=lay.num_tiles_1 if tiles is None else tiles, out_RN=h,
            push=sb.dispatch(plan, x, tw) if push else None, wait=push and tiles is None,
            local_rows=lay if local_a and push else None,
        )  # fmt: skip

    def timed(fn) -> float:
        return time_collective(fn, calls_per_sample=3)

    out = [
        ("whole op (bench's T_measured)", timed(lambda: (prologue(), kernel()))),
        ("prologue: routing sort + count exchange + layout", timed(prologue)),
        ("kernel, comm only (local A)", timed(lambda: kernel(tiles=no_tiles))),
        ("kernel, GEMM only", timed(lambda: kernel(push=False))),
        ("kernel, own rows copied into the pool", timed(lambda: kernel(local_a=False))),
    ]
    if ws.shapes["bcast_x"][0][0]:  # MEGAMOE_SYMM_DISPATCH=broadcast: copy engines, no comm role
        send_weight = plan.send.row_values_R(tw).float()

        def broadcast(tiles: torch.Tensor | None = None):
            launch.begin_op(ws)
            launch.broadcast_rows(ws, x, plan.send.row_token_R, send_weight)
            launch.fused_gemm(
                ws, op="gemm1", a_RK=pool, b=w1, b_kn=False, tiles_X3=lay.tiles_X3,
                num_tiles_1=lay.num_tiles_1 if tiles is None else tiles, out_RN=h, wait=True,
                local_rows=lay, broadcast=(x, plan.send.row_token_R),
            )  # fmt: skip
            launch.join_broadcast(ws)

        out += [
            ("kernel, broadcast: copy engines | GEMM1 gathering the copies", timed(broadcast)),
            ("kernel, broadcast copies and flags only", timed(lambda: broadcast(no_tiles))),
        ]
    for label, env in KNOBS:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        out.append((f"kernel, {label}", timed(kernel)))
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    return out


def _timeline(world: int) -> list[str]:
    """Per-program timeline of one fused kernel (``MEGAMOE_SYMM_TRACE=1``), this rank; ms from the first
    program's start: the spread of each event over the programs."""
    from benchmarks.common import MODELS, rank_inputs
    from megamoe.backends.symm import launch
    from megamoe.backends.symm.backend import SymmBackend
    from megamoe.settings import SymmSettings

    x, idx, tw, w1, _ = rank_inputs(MODELS["DeepSeek-V3"], "uniform", world, dist.get_rank())
    sb = SymmBackend(SymmSettings.from_env())
    E, lines = w1.shape[0] * world, []
    for label, env, push in (
        ("defaults", {}, True),
        ("every tile from the counter", {"MEGAMOE_SYMM_FLAT_WAIT": "0"}, True),
        ("GEMM only", {}, False),
    ):
        saved = dict(os.environ)
        os.environ.update(env, MEGAMOE_SYMM_TRACE="1")
        for _ in range(4):  # the last call is the one read back
            plan = sb.make_plan(idx, num_experts=E, group=dist.group.WORLD)
            h = sb.stage1_forward(x, tw, w1, plan)[0]
            if not push:
                lay = plan.layout
                launch.begin_op(plan.ws)
                launch.fused_gemm(plan.ws, op="gemm1", a_RK=plan.ws.view("pool"), b=w1, b_kn=False,
                                  tiles_X3=lay.tiles_X3, num_tiles_1=lay.num_tiles_1, out_RN=h)  # fmt: skip
            torch.cuda.synchronize()
            dist.barrier()
        has_comm_role = push and SymmSettings.from_env().dispatch_mode(world) != "broadcast"
        comm = SymmSettings.from_env().comm_programs if has_comm_role else 0
        os.environ.clear()
        os.environ.update(saved)
        t = launch.program_timeline(plan.ws).cpu()
        ms = (t[:, :4] - t[:, 0].min()).double() / 1e6

        def spread(v: torch.Tensor) -> str:
            v = v.sort().values
            return f"{v[0]:.3f} / {v[len(v) // 2]:.3f} / {v[-1]:.3f}"

        rows = [("all programs: end", ms[:, 3])]
        if comm:
            own = [p for p in range(comm) if p % world == 0]  # the programs serving this rank itself
            peers = [p for p in range(comm) if p % world]
            rows += [
                ("comm programs serving this rank: comm done", ms[own, 1]),
                ("comm programs serving peers: comm done", ms[peers, 1]),
                ("comm programs: counter tiles", t[:comm, 4].double()),
            ]
        rows += [
            ("GEMM programs: fixed-stride tiles done", ms[comm:, 2]),
            ("GEMM programs: counter tiles", t[comm:, 4].double()),
        ]
        lines += [f"| {label} | {what} | {spread(v)} |" for what, v in rows]
    return lines


def _profile(fn, calls: int = 3) -> list:
    """torch.profiler's CUDA events of ``calls`` back-to-back calls of ``fn`` (after as many warm-up calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    dist.barrier()
    return sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )


def _gpu_events(world: int) -> list[str]:
    """Every fused op of the EP path (the environment's dispatch mode) and its GEMM-only leg, three
    back-to-back calls each under torch.profiler (this rank): per kernel or copy, its stream, calls and
    mean ms, and the span of the three calls divided by three."""
    from benchmarks.bench_ep import op_legs
    from benchmarks.common import MODELS

    rows = []
    for mode in ("dispatch_grouped_gemm", "grouped_gemm_combine"):
        ops, _, _, _ = op_legs(MODELS["DeepSeek-V3"], "uniform", dist.group.WORLD, mode)
        for op in ops:
            for leg, fn in (("op", op.full), ("GEMM leg", op.gemm)):
                events = _profile(fn)
                if not events:
                    continue
                span = (max(e.time_range.end for e in events) - events[0].time_range.start) / 3e3
                rows.append(f"| **{op.stage}**, {leg} | | | {span:.3f} (span / 3) |")
                kinds: dict[tuple[str, object], list[float]] = {}
                for e in events:
                    key = (e.name[:70], getattr(e, "device_resource_id", "?"))
                    kinds.setdefault(key, []).append((e.time_range.end - e.time_range.start) / 1e3)
                for (name, stream), durations in kinds.items():
                    rows.append(
                        f"| {name} | {stream} | {len(durations)} | {sum(durations) / len(durations):.3f} |"
                    )
    return rows


def _worker(rank: int, world: int, port: int, out: str | None, gpu_events: bool) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    legs = _legs(world)
    timeline = _timeline(world)
    events = _gpu_events(world) if gpu_events else []
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name(0)}, DeepSeek-V3 per-rank shape, uniform routing")
        print("| leg | ms |\n|---|---|")
        for label, ms in legs:
            print(f"| {label} | {ms:.3f} |")
        print(
            "\nTimeline of one kernel, rank 0 (ms from the first program's start; min / median / max over programs)"
        )
        print("| kernel | event | min / median / max |\n|---|---|---|")
        print("\n".join(timeline))
        if events:
            print("\nGPU events of every op and its GEMM leg, rank 0 (three back-to-back calls each)")
            print("| kernel or copy | stream | calls | mean ms |\n|---|---|---|---|")
            print("\n".join(events))
        if out:
            with open(out, "w") as f:
                json.dump({"world": world, "legs": dict(legs), "timeline": timeline}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-processes", type=int, default=2, help="GPUs of this node, one process each")
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument(
        "--gpu-events", action="store_true", help="also profile every op and its GEMM leg (torch.profiler)"
    )
    args = p.parse_args()
    if torch.cuda.device_count() < args.num_processes:
        raise SystemExit(
            f"--num-processes {args.num_processes} needs as many GPUs; found {torch.cuda.device_count()}"
        )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(
        _worker,
        args=(args.num_processes, port, args.out, args.gpu_events),
        nprocs=args.num_processes,
        join=True,
    )


if __name__ == "__main__":
    main()
