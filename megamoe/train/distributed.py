"""Process groups: torchrun's environment in, megatron-core's parallel state up, an ordered teardown out.

gloo on CPU, NCCL on GPU. The teardown order (barrier, destroy model-parallel groups, destroy the
process group) matters: without it gloo occasionally aborts at interpreter exit after a good run.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megamoe.train.schema import PretrainConfig


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """This process's place in the job, read from torchrun's variables."""

    rank: int
    world_size: int
    local_rank: int


def rank_info(environ: Mapping[str, str]) -> RankInfo:
    """torchrun's RANK/WORLD_SIZE/LOCAL_RANK; a plain ``python -m`` run is rank 0 of 1."""
    return RankInfo(
        rank=int(environ.get("RANK", "0")),
        world_size=int(environ.get("WORLD_SIZE", "1")),
        local_rank=int(environ.get("LOCAL_RANK", "0")),
    )


def init_distributed(info: RankInfo, environ: Mapping[str, str], timeout_s: float = 600.0) -> None:
    """Join the default process group (a 1-rank job gets a private local store)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in environ:
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout)
    else:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


def init_model_parallel(cfg: PretrainConfig, virtual_pipeline_size: int | None) -> None:
    """megatron-core's TP/PP/EP/DP groups, then the CPU compatibility patches (no-op on GPU)."""
    from megatron.core import parallel_state

    from megamoe.megatron.compat import apply_cpu_compat

    p = cfg.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
    )
    apply_cpu_compat()


def teardown(*, wait_for_peers: bool) -> None:
    """Leave the job so no rank hangs or aborts at exit; after an error, without waiting for peers."""
    if not dist.is_initialized():
        return
    from megatron.core import parallel_state

    if wait_for_peers:
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def cpu_threads(environ: Mapping[str, str]) -> None:
    """One intra-op thread per rank on CPU unless OMP_NUM_THREADS says otherwise (ranks share cores)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))


def environ_snapshot() -> dict[str, str]:
    """The process environment, read once by the entry point and passed down."""
    return dict(os.environ)
