"""What the benchmarks share: the per-rank model shapes, their routing and inputs, and the timers.

Shape letters as in DESIGN.md: T tokens, H hidden, I expert intermediate, G local experts, K top-k.

* :data:`MODELS` — the expert path of one EP8 rank of each benchmarked model (:class:`ModelShape`);
  :func:`make_routing` routes its tokens (uniform or Zipf-skewed), :func:`rank_inputs` builds one
  rank's bf16 inputs at EP = N.
* One GPU: :func:`time_interleaved` (median ms over interleaved rounds of ``triton.testing.do_bench``)
  and :func:`peak_gib` (peak memory above what was allocated before).
* Every rank of a process group: :func:`time_collective_interleaved` / :func:`time_collective`
  (fixed counts, event-timed after a spin kernel, the slowest rank's median).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.errors import InvalidConfigError


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The expert path of one EP8 rank: hidden, intermediate, local experts, top-k, tokens."""

    hidden: int
    inter: int
    experts: int
    topk: int
    tokens: int


SMALL_T_SHAPES = {
    # name: (hidden, expert intermediate, experts, top-k) of the small-token-count benchmarks
    "H1024-E8-K2": (1024, 512, 8, 2),
    "H2048-E32-K4": (2048, 1024, 32, 4),
    "H4096-E64-K8": (4096, 1536, 64, 8),
}

MODELS = {
    "DeepSeek-V3": ModelShape(hidden=7168, inter=2048, experts=32, topk=8, tokens=8192),
    "Qwen3-30B-A3B": ModelShape(hidden=2048, inter=768, experts=128, topk=8, tokens=16384),
    "Qwen3-235B-A22B": ModelShape(hidden=4096, inter=1536, experts=16, topk=8, tokens=8192),
}


def make_routing(
    shape: ModelShape, routing: str, *, device: torch.device, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``topk_idx, topk_weights [T, K]``: K distinct experts per token, uniform or Zipf-skewed popularity."""
    g = torch.Generator(device=device).manual_seed(seed)
    T, E, K = shape.tokens, shape.experts, shape.topk
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=g, device=device).clamp_min(1e-20)))
    if routing == "skewed":
        # popularity ~ 1/rank^1.2 over a random permutation: the hottest expert gets several times
        # the mean load and the coldest a small fraction of it.
        rank = torch.randperm(E, generator=g, device=device).float() + 1
        gumbel = gumbel - 1.2 * torch.log(rank)
    elif routing != "uniform":
        raise InvalidConfigError("--routing", routing, "unknown", "Use uniform or skewed")
    idx = gumbel.topk(K, dim=1).indices
    weights = torch.softmax(torch.randn(T, K, generator=g, device=device), dim=1)
    return idx, weights


def rank_inputs(
    shape: ModelShape, routing: str, world: int, rank: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``x [T, H], topk_idx [T, K], topk_weights [T, K], w1 [G, 2I, H], w2 [G, H, I]`` of ``rank`` at
    EP = ``world`` on the current CUDA device: its T tokens routed over ``world x G`` experts, seeded
    by the rank."""
    torch.manual_seed(rank)
    T, H, I, G, K = shape.tokens, shape.hidden, shape.inter, shape.experts, shape.topk
    global_shape = ModelShape(hidden=H, inter=I, experts=G * world, topk=K, tokens=T)
    idx, tw = make_routing(global_shape, routing, device=torch.device("cuda"), seed=rank)
    dt = torch.bfloat16
    x = torch.randn(T, H, device="cuda", dtype=dt)
    w1 = torch.randn(G, 2 * I, H, device="cuda", dtype=dt) / H**0.5
    w2 = torch.randn(G, H, I, device="cuda", dtype=dt) / I**0.5
    return x, idx, tw, w1, w2


# ---------------------------------------------------------------------------- one GPU

ROUNDS = 10  # interleaved rounds of a comparison
ROUND_MS = 60  # time budget of one implementation's repeats in one round


def time_interleaved(cases: list[tuple[Callable[[], object], list[Tensor]]]) -> list[float]:
    """Median ms of each ``(fn, grads_to_reset)`` over :data:`ROUNDS` rounds that time them in turn.

    Timing A's repeats, then B's, would charge the card's clock drift (a power-capped H200 runs
    5-15 % slower once warm) to B; alternating spreads it over both."""
    from triton.testing import do_bench

    samples: list[list[float]] = [[] for _ in cases]
    for fn, grads in cases:  # warm-up and compile outside the timed rounds
        do_bench(fn, warmup=25, rep=1, grad_to_none=grads)
    for _ in range(ROUNDS):
        for times, (fn, grads) in zip(samples, cases, strict=True):
            times.append(do_bench(fn, warmup=1, rep=ROUND_MS, grad_to_none=grads, return_mode="median"))
    return [statistics.median(times) for times in samples]


T = TypeVar("T")


def capture(step: Callable[[], T], *, warmup: int) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``step`` ``warmup`` times on a side stream (compiles, lazy allocations and workspaces happen
    outside the graph), then capture one call in a CUDA graph; returns the graph and that call's
    outputs. The benches time its replay; the GPU tests compare the replay with eager."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def peak_gib(fn: Callable[[], object]) -> float:
    """Peak CUDA memory of one call of ``fn`` above what was allocated before it, in GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


# ---------------------------------------------------------------------------- every rank of a group

HOLD_CYCLES = 10_000_000
"""GPU clock cycles a spin kernel holds the stream before each sample's start event (~5 ms at the
H200's 1.98 GHz): the host enqueues the sample's calls meanwhile, so the GPU never waits for it."""


def time_collective(
    fn: Callable[[], object], *, warmup: int = 5, repeats: int = 20, calls_per_sample: int = 1
) -> float:
    """:func:`time_collective_interleaved` of one function."""
    return time_collective_interleaved(
        [fn], warmup=warmup, repeats=repeats, calls_per_sample=calls_per_sample
    )[0]


def time_collective_interleaved(
    fns: list[Callable[[], object]],
    *,
    warmup: int = 5,
    repeats: int = 20,
    calls_per_sample: int = 1,
    rounds: int = 5,
) -> list[float]:
    """Median ms of each of ``fns`` over ``repeats`` event-timed samples on every rank; the slowest
    rank's median. The samples are taken in ``rounds`` rounds that visit every function in turn, so
    the card's clock drift (power-capped, it slows as it warms) falls on the legs of one comparison
    alike instead of on whichever was timed last.

    A sample is ``calls_per_sample`` back-to-back calls divided by that count, timed from the end of a
    spin kernel (:data:`HOLD_CYCLES`) during which the host enqueues them: as in a training step, where
    the host runs ahead of the GPU, the device time is measured, not the host's launch latency (about
    1.7 ms of Python and launches before the fused kernel of a lone stage-1 op on an idle GPU). A path
    that syncs with the host inside (the baseline layer reads its split sizes) waits out the spin
    there, as it would wait for the previous layer in training. Fixed counts (not ``do_bench``'s
    adaptive ones) because every rank must make the same calls.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, samples in zip(fns, times, strict=True):
            for _ in range(-(-repeats // rounds)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(HOLD_CYCLES)
                start.record()
                for _ in range(calls_per_sample):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / calls_per_sample)
    medians = torch.tensor([statistics.median(t) for t in times], device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return medians.tolist()
