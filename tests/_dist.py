"""Run a function on N real torch.distributed ranks (gloo on CPU) and collect what each returns.

Each gloo rank is a fresh process forked from a ``forkserver`` that has imported torch, megamoe and
megatron-core once (about 3 s and 9 s a process under ``spawn``), running with the test's
environment as it is at the call; nccl ranks are ``spawn`` processes (nothing CUDA before them). Each
has its own FileStore rendezvous under ``tmp_path`` (no fixed port), ``torch.set_num_threads(1)``, and an ordered teardown (barrier, megatron's
``destroy_model_parallel`` if it was used, ``destroy_process_group``) because gloo can abort at
interpreter exit otherwise. A rank's exception is re-raised in the test with its traceback; a rank
that hangs fails the test after ``timeout`` seconds instead of hanging CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class RankFailed(AssertionError):
    pass


_PRELOAD = ["torch", "torch.distributed", "megamoe", "megamoe.layer", "megatron.core.parallel_state"]
"""what the gloo ranks' forkserver imports once (a module that fails to import is skipped)"""


def _worker(
    rank: int, world: int, store_path: str, backend: str, fn: Callable, args: tuple, queue, environ: dict
) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's, not the forkserver's from when it started
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        if backend == "nccl":  # one GPU per rank; NVLink multicast stays off (it can take a shared host down)
            os.environ.update(
                NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
            )
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.barrier()
        if "megatron.core.parallel_state" in sys.modules:
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
        dist.destroy_process_group()
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # the test process reports it
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable, world: int, tmp_path: Path, *args: Any, timeout: float = 240.0, backend: str = "gloo"
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks (gloo on CPU, or nccl with one GPU each); returns the
    per-rank results in rank order."""
    if backend == "gloo":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
    else:
        ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / f"store-{os.getpid()}-{id(fn)}")
    procs = [
        ctx.Process(target=_worker, args=(r, world, store, backend, fn, args, queue, dict(os.environ)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                break
    except Exception as e:  # queue.Empty: some rank hangs
        failures.append(
            f"ranks {sorted(set(range(world)) - set(results))} gave no result in {timeout}s ({e!r})"
        )
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RankFailed("\n".join(failures))
    return [results[r] for r in range(world)]
