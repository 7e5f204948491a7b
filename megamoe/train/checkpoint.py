"""Checkpoints with megatron-core ``dist_checkpointing`` (``torch_dist``), and resume from the latest.

Layout, as Megatron writes it: ``<dir>/iter_0000020/`` (one sharded checkpoint: model chunks,
optimizer, LR scheduler, iteration, per-rank RNG states) and ``<dir>/latest_checkpointed_iteration.txt``,
written by rank 0 only after every rank has finished, so a run killed mid-save resumes from the
previous complete checkpoint. Data needs no state: batches are addressed by iteration (``data.py``).

Each checkpoint also holds the run's resolved ``config.yaml`` and a ``manifest.json`` (every file's
size, the parallel layout, the vocabulary), written last. On resume the newest checkpoint whose files
match its manifest is used: a truncated or missing file is reported by name, and the run falls back
to the checkpoint before it (``strict_resume`` stops instead). A layout or model shape that differs
from the checkpoint's is reported by setting before anything is read.
"""

from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megamoe.errors import InvalidConfigError

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
CONFIG = "config.yaml"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}
"""Optimizer-state layout: each rank's distributed-optimizer buffers as they are (fully parallel I/O,
reshardable over DP only). megatron-core 0.16's default, ``fully_sharded_model_space``, builds
``flattened_range`` shards that its own checkpoint validation then rejects."""


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What a checkpoint's shards depend on, recorded in its manifest and checked on resume."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    expert_model_parallel_size: int
    data_parallel_size: int
    vocab_size: int
    """The embedding's rows before padding."""
    model: dict[str, Any]
    """The settings that give the parameters their shapes."""


SHAPE_SETTINGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "make_vocab_size_divisible_by", "swiglu", "add_bias_linear",
    "add_qkv_bias", "qk_layernorm", "normalization", "untie_embeddings_and_output_weights",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
    "v_head_dim", "mtp_num_layers", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
)  # fmt: skip


def _checkpoint_dirs(root: Path, up_to: int) -> list[tuple[int, Path]]:
    """``iter_*`` folders under ``root`` up to iteration ``up_to``, newest first."""
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _ITER_DIR.match(child.name)
        if match and child.is_dir() and int(match.group(1)) <= up_to:
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def problem_with(folder: Path) -> str | None:
    """Why the checkpoint in ``folder`` cannot be read back whole, naming the file; None if it can.

    A checkpoint without a manifest (written before manifests existed) is taken as it is."""
    manifest = folder / MANIFEST
    if not folder.is_dir():
        return "the folder is missing"
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} is {actual:,} bytes but was written with {size:,} (truncated or overwritten)"
    return None


def _saved_facts(folder: Path) -> Facts | None:
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    facts = json.loads(manifest.read_text()).get("facts")
    return Facts(**facts) if facts else None


def _write_manifest(folder: Path, facts: Facts) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files, "facts": asdict(facts)}, indent=1) + "\n")
    tmp.replace(folder / MANIFEST)


def check_compatible(saved: Facts, current: Facts, folder: Path, *, with_optimizer: bool) -> None:
    """Stop, naming the setting, when this run cannot read the checkpoint's shards as they are."""
    for name in SHAPE_SETTINGS:
        was, now = saved.model.get(name), current.model.get(name)
        if was != now:
            raise InvalidConfigError(
                name, now, f"the checkpoint in {folder} was written with {name}={was!r}: a different model",
                f"Resume with {name}={was!r}, or save this model elsewhere (--save DIR or a new --exp_name)",
            )  # fmt: skip
    if saved.vocab_size != current.vocab_size:
        raise InvalidConfigError(
            "vocab_size", current.vocab_size,
            f"the checkpoint in {folder} has a vocabulary of {saved.vocab_size} (its tokenizer or vocab_size)",
            "Use the tokenizer (or vocab_size) the checkpoint was trained with",
        )  # fmt: skip
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        was, now = getattr(saved, name), getattr(current, name)
        if was != now and with_optimizer:
            raise InvalidConfigError(
                name, now,
                f"the checkpoint in {folder} was written with {name}={was}, and its optimizer state is "
                "sharded by that layout",
                f"Resume with {name}={was}, or pass --no_load_optim true to load the weights into the new "
                "layout with a fresh optimizer state",
            )  # fmt: skip


def select_checkpoint(root: Path, *, strict: bool) -> tuple[int | None, list[str]]:
    """The newest complete checkpoint's iteration under ``root`` (None: none yet) and the warnings
    about newer ones that are not complete. Raises instead of skipping when ``strict``."""
    latest = latest_iteration(root)
    if latest is None:
        return None, []
    warnings: list[str] = []
    candidates = _checkpoint_dirs(root, latest)
    if not candidates or candidates[0][0] != latest:
        candidates.insert(0, (latest, iteration_dir(root, latest)))
    for iteration, folder in candidates:
        problem = problem_with(folder)
        if problem is None:
            return iteration, warnings
        if strict:
            raise InvalidConfigError(
                "load", str(folder), f"the newest checkpoint is incomplete: {problem}",
                "Drop --strict_resume to resume from the newest complete one, or delete that folder",
            )  # fmt: skip
        warnings.append(f"checkpoint {folder} is incomplete ({problem}); trying the one before it")
    raise InvalidConfigError(
        "load", str(root), "no complete checkpoint: " + "; ".join(warnings),
        "Point load at a folder with a complete checkpoint, or pass --overwrite_checkpoints true to start afresh",
    )  # fmt: skip


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
    config_yaml: str,
    facts: Facts,
    with_optimizer: bool = True,
    with_rng: bool = True,
) -> Path:
    """Write the checkpoint of ``iteration`` on every rank; then rank 0 adds the config and the
    manifest and publishes it in the tracker file, in that order."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    for chunk in chunks:  # overlapped param all-gather: make every rank's weights current first
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
    target = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
        for stale in (MANIFEST, CONFIG):  # an older save of this iteration: it no longer describes the files
            (target / stale).unlink(missing_ok=True)
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
        (target / CONFIG).write_text(config_yaml)
        _write_manifest(target, facts)
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
    facts: Facts,
    strict: bool = False,
    finetune: bool = False,
    with_optimizer: bool = True,
    with_rng: bool = True,
) -> int:
    """Restore the newest complete checkpoint under ``root``; returns the iteration to continue from
    (0 if there is none). Every rank gets rank 0's choice."""
    from megatron.core import dist_checkpointing

    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            choice[0] = select_checkpoint(root, strict=strict)
        except InvalidConfigError as e:
            choice[0] = e
    dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], InvalidConfigError):
        raise choice[0]
    iteration, warnings = choice[0]
    if dist.get_rank() == 0:
        for warning in warnings:
            logger.warning(warning)
    if iteration is None:
        return 0
    with_optimizer = with_optimizer and not finetune
    with_rng = with_rng and not finetune
    source = iteration_dir(root, iteration)
    saved = _saved_facts(source)
    if saved is not None:
        check_compatible(saved, facts, source, with_optimizer=with_optimizer)
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
    try:
        state = dist_checkpointing.load(template, str(source))
    except Exception as e:  # megatron-core raises many kinds; the user needs the folder and the first line
        raise InvalidConfigError(
            "load", str(source), f"megatron-core could not read it: {str(e).strip().splitlines()[0][:300]}",
            "Delete that folder to resume from the checkpoint before it, or pass --no_load_optim true if the "
            "parallel layout changed",
        ) from e  # fmt: skip
    if with_optimizer:
        _report_schedule(scheduler, schedule_differences(scheduler, state["opt_param_scheduler"]))
    with torch.no_grad():  # the optimizer copies into its (leaf, grad-requiring) main params in place
        _restore(state, chunks, optimizer, scheduler, with_optimizer=with_optimizer, with_rng=with_rng)
    logger.info("resumed from %s (iteration %d)", source, iteration)
    return 0 if finetune else int(state["iteration"])


_SCHEDULE = {
    "max_lr": "lr", "min_lr": "min_lr", "lr_warmup_steps": "lr_warmup_iters (in samples)",
    "lr_decay_steps": "lr_decay_iters or train_iters (in samples)", "lr_decay_style": "lr_decay_style",
    "start_wd": "start_weight_decay", "end_wd": "end_weight_decay",
    "wd_incr_steps": "train_iters for the weight-decay schedule (in samples)",
}  # fmt: skip


def schedule_differences(scheduler: Any, saved: dict[str, Any]) -> list[str]:
    """``setting: config X, checkpoint Y`` for each LR/WD schedule value where the two disagree."""
    return [
        f"{setting}: config {getattr(scheduler, key)!r}, checkpoint {saved[key]!r}"
        for key, setting in _SCHEDULE.items()
        if key in saved and getattr(scheduler, key, None) != saved[key]
    ]


def _report_schedule(scheduler: Any, diffs: list[str]) -> None:
    """Say which schedule a resumed run follows and the flag that picks the other (megatron-core's two
    switches); with both off, stop as Megatron-LM does, but with the remedy."""
    if not diffs:
        return
    text = "the LR schedule differs from the checkpoint's: " + "; ".join(diffs)
    if scheduler.override_opt_param_scheduler:
        used = "The config's is used (override_opt_param_scheduler); drop that flag to keep the checkpoint's"
    elif scheduler.use_checkpoint_opt_param_scheduler:
        used = "The checkpoint's is used; pass --override_opt_param_scheduler true to use the config's"
    else:
        raise InvalidConfigError(
            "use_checkpoint_opt_param_scheduler", False, text,
            "Pass --override_opt_param_scheduler true (the config's) or --use_checkpoint_opt_param_scheduler "
            "true (the checkpoint's)",
        )  # fmt: skip
    if dist.get_rank() == 0:
        logger.warning("%s. %s", text, used)


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
