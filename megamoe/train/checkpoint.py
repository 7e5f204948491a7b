"""Checkpoints with megatron-core ``dist_checkpointing`` (``torch_dist``), and resume from the latest.

Layout, as Megatron writes it: ``<dir>/iter_0000020/`` (one sharded checkpoint: model chunks,
optimizer, LR scheduler, iteration, per-rank RNG states) and ``<dir>/latest_checkpointed_iteration.txt``,
written by rank 0 only after every rank has finished, so a run killed mid-save resumes from the
previous complete checkpoint. Data needs no state: batches are addressed by iteration (``data.py``).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megamoe.errors import InvalidConfigError

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}
"""Optimizer-state layout: each rank's distributed-optimizer buffers as they are (fully parallel I/O,
reshardable over DP only). megatron-core 0.16's default, ``fully_sharded_model_space``, builds
``flattened_range`` shards that its own checkpoint validation then rejects."""


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def latest_iteration(root: Path) -> int | None:
    """The iteration of the newest complete checkpoint under ``root`` (None when there is none)."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise InvalidConfigError(
            "load",
            str(root),
            f"{TRACKER} holds {text!r}, not an iteration number",
            "Delete the file or point load at a valid checkpoint folder",
        )
    return int(text)


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state["tracker"]:
        get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    iteration: int,
    *,
    loading: bool,
    with_optimizer: bool,
    with_rng: bool,
) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = {"iteration": iteration}
    model_state: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        state[key] = chunk.module.sharded_state_dict()
        model_state.update(state[key])
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=SHARDING)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state


def _materialize_adam_state(optimizer: Any) -> None:
    """Give torch Adam zeroed moments and ``step`` before loading.

    Without Transformer Engine or Apex, megatron-core 0.16's DistributedOptimizer reads ``step`` from
    torch's Adam state to build the loading template, and that state only exists after a first step
    (``assert len(steps) == 1``). The values are placeholders: the checkpoint overwrites them.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def _saved_steps(tree: Any) -> set[float]:
    """Every ``param_groups[*].step`` in a loaded optimizer state (the Adam step count at save time)."""
    found: set[float] = set()
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "param_groups" and isinstance(value, list):
                found.update(float(g["step"]) for g in value if isinstance(g, dict) and "step" in g)
            else:
                found |= _saved_steps(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            found |= _saved_steps(value)
    return found


def _restore_adam_steps(optimizer: Any, loaded: Any) -> None:
    """Put the saved Adam step count back, one tensor per parameter.

    megatron-core 0.16's DistributedOptimizer (torch-Adam path, no TE/Apex) restores ``step`` from
    the loading template, i.e. the placeholder, and shares one tensor among all parameters (torch's
    Adam then increments it once per parameter). Either way the bias correction after a resume would
    leave the uninterrupted run's loss curve.
    """
    steps = _saved_steps(loaded)
    if not steps:
        return
    if len(steps) != 1:
        raise InvalidConfigError(
            "load",
            sorted(steps),
            "the checkpoint holds different Adam step counts",
            "Resume from a checkpoint written by this trainer",
        )
    step = steps.pop()
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for state in inner.state.values():
                state["step"] = torch.tensor(step)


def save(
    root: Path,
    iteration: int,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    *,
    with_optimizer: bool = True,
    with_rng: bool = True,
) -> Path:
    """Write the checkpoint of ``iteration`` on every rank, then publish it in the tracker file."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    for chunk in chunks:  # overlapped param all-gather: make every rank's weights current first
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
    target = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(
        chunks,
        optimizer,
        scheduler,
        iteration,
        loading=False,
        with_optimizer=with_optimizer,
        with_rng=with_rng,
    )
    dist_checkpointing.save(
        state, str(target), get_default_save_sharded_strategy("torch_dist"), content_metadata=SHARDING
    )
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / (TRACKER + ".tmp")
        tmp.write_text(f"{iteration}\n")
        tmp.replace(root / TRACKER)
    dist.barrier()
    return target


def load(
    root: Path,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    *,
    finetune: bool = False,
    with_optimizer: bool = True,
    with_rng: bool = True,
) -> int:
    """Restore the latest checkpoint under ``root``; returns the iteration to continue from (0 if none)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if iteration is None:
        return 0
    with_optimizer = with_optimizer and not finetune
    with_rng = with_rng and not finetune
    source = iteration_dir(root, iteration)
    if with_optimizer:
        _materialize_adam_state(optimizer)
    template = _sharded_state(
        chunks,
        optimizer,
        scheduler,
        iteration,
        loading=True,
        with_optimizer=with_optimizer,
        with_rng=with_rng,
    )
    state = dist_checkpointing.load(template, str(source))
    with torch.no_grad():  # the optimizer copies into its (leaf, grad-requiring) main params in place
        _restore(state, chunks, optimizer, scheduler, with_optimizer=with_optimizer, with_rng=with_rng)
    logger.info("resumed from %s (iteration %d)", source, iteration)
    return 0 if finetune else int(state["iteration"])


def _restore(
    state: dict[str, Any],
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    *,
    with_optimizer: bool,
    with_rng: bool,
) -> None:
    for i, chunk in enumerate(chunks):
        chunk.module.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=True)
    if with_optimizer:
        optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(optimizer, state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if with_rng:
        _set_rng_state(state["rng_state"])
