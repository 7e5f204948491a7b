"""Start-up checks: every setting this trainer cannot honour fails here, by name, before any step.

:func:`plan_run` needs only the config and two host facts (world size, whether CUDA is present), so
``--dry-run`` and tests reach the same verdict as a real launch. It also derives the batch geometry
and the checkpoint folders, and lists the notes (ignored kernel hints) that rank 0 logs once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from megamoe.errors import InvalidConfigError, UnsupportedSettingError
from megamoe.train.schema import KernelHints, PretrainConfig


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What the config means on this world: sizes, micro-batches, folders, and notes to log once."""

    world_size: int
    data_parallel_size: int
    num_microbatches: int
    global_batch_size: int
    save_dir: Path
    load_dir: Path
    cuda_graph_impl: str
    gradient_accumulation_fusion: bool
    notes: tuple[str, ...] = field(default=())


def plan_run(cfg: PretrainConfig, *, world_size: int, has_cuda: bool) -> RunPlan:
    """Validate ``cfg`` for ``world_size`` ranks; raise the first problem with its setting's name."""
    _check_unsupported(cfg, has_cuda)
    _check_consistency(cfg)
    dp = _data_parallel_size(cfg, world_size)
    t = cfg.training
    gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        raise InvalidConfigError(
            "global_batch_size",
            gbs,
            f"not divisible by micro_batch_size * data_parallel_size = {t.micro_batch_size} * {dp}",
            f"Use a multiple of {t.micro_batch_size * dp}",
        )
    save = Path(cfg.checkpoint.save or f"{cfg.output_dir}/checkpoints")
    return RunPlan(
        world_size=world_size,
        data_parallel_size=dp,
        num_microbatches=gbs // (t.micro_batch_size * dp),
        global_batch_size=gbs,
        save_dir=save,
        load_dir=Path(cfg.checkpoint.load) if cfg.checkpoint.load else save,
        cuda_graph_impl=_cuda_graph_impl(cfg),
        gradient_accumulation_fusion=cfg.training.gradient_accumulation_fusion and _has_fused_wgrad(),
        notes=tuple(_notes(cfg)),
    )


def _unsupported(setting: str, value: object, problem: str, remedy: str) -> UnsupportedSettingError:
    return UnsupportedSettingError(setting, value, problem, remedy)


def _check_unsupported(cfg: PretrainConfig, has_cuda: bool) -> None:
    t, m, p, c = cfg.training, cfg.moe, cfg.parallel, cfg.checkpoint
    checks = [
        (
            not cfg.data.mock_data,
            "mock_data",
            False,
            "only megatron-core's mock GPT data is implemented",
            "Set mock_data: true",
        ),
        (
            c.ckpt_format != "torch_dist",
            "ckpt_format",
            c.ckpt_format,
            "only megatron-core distributed checkpoints are implemented",
            "Set ckpt_format: torch_dist",
        ),
        (c.async_save, "async_save", True, "asynchronous saving is not implemented", "Set async_save: false"),
        (
            t.fp8 is not None,
            "fp8",
            t.fp8,
            "fp8 training needs Transformer Engine, which this trainer does not use",
            "Set fp8: null (MegaMoE's expert precision is turbo_mega_moe_precision)",
        ),
        (
            t.recompute_layer_ids is not None,
            "recompute_layer_ids",
            t.recompute_layer_ids,
            "a Primus-only switch with no megatron-core equivalent",
            "Set recompute_layer_ids: null and use recompute_method / recompute_num_layers",
        ),
        (t.eval_iters > 0, "eval_iters", t.eval_iters, "evaluation is not implemented", "Set eval_iters: 0"),
        (
            p.context_parallel_size > 1,
            "context_parallel_size",
            p.context_parallel_size,
            "context parallelism needs Transformer Engine attention",
            "Set context_parallel_size: 1",
        ),
        (
            m.moe_token_dispatcher_type == "flex",
            "moe_token_dispatcher_type",
            "flex",
            "the flex dispatcher needs DeepEP/HybridEP",
            "Use alltoall or allgather (or MegaMoE)",
        ),
        (
            m.moe_grouped_gemm,
            "moe_grouped_gemm",
            True,
            "megatron-core's grouped-GEMM experts need Transformer Engine or the grouped_gemm package",
            "Set moe_grouped_gemm: false, or use_turbo_mega_moe: true for the fused path",
        ),
        (
            t.cuda_graph_impl == "transformer_engine"
            and importlib.util.find_spec("transformer_engine") is None,
            "cuda_graph_impl",
            "transformer_engine",
            "Transformer Engine is not installed",
            "Leave cuda_graph_impl null (megatron-core's local CUDA graphs) or install transformer_engine",
        ),
        (
            cfg.optimizer.use_precision_aware_optimizer,
            "use_precision_aware_optimizer",
            True,
            "needs Transformer Engine's FusedAdam",
            "Set use_precision_aware_optimizer: false",
        ),
    ]
    if not has_cuda:
        checks += [
            (
                t.external_cuda_graph,
                "external_cuda_graph",
                True,
                "CUDA graphs need a CUDA GPU",
                "Set external_cuda_graph: false on CPU",
            ),
            (
                t.recompute_granularity is not None,
                "recompute_granularity",
                t.recompute_granularity,
                "activation recompute reads the CUDA RNG state (megatron-core tensor_parallel.checkpoint)",
                "Set recompute_granularity: null on CPU",
            ),
            (
                m.moe_layer_recompute,
                "moe_layer_recompute",
                True,
                "activation recompute reads the CUDA RNG state",
                "Set moe_layer_recompute: false on CPU",
            ),
        ]
    for failed, setting, value, problem, remedy in checks:
        if failed:
            raise _unsupported(setting, value, problem, remedy)


def _check_consistency(cfg: PretrainConfig) -> None:
    t, o, p, m = cfg.training, cfg.optimizer, cfg.parallel, cfg.moe
    if p.tensor_model_parallel_size > 1 and m.num_experts is not None and not p.sequence_parallel:
        raise InvalidConfigError(
            "sequence_parallel",
            False,
            f"megatron-core trains MoE layers with tensor_model_parallel_size={p.tensor_model_parallel_size} "
            "only with sequence parallelism",
            "Set sequence_parallel: true, or tensor_model_parallel_size: 1 (MoE scales by EP)",
        )
    if p.sequence_parallel and not (_installed("transformer_engine") or _installed("apex")):
        raise UnsupportedSettingError(
            "sequence_parallel",
            True,
            "megatron-core's sequence-parallel LayerNorm needs Transformer Engine or Apex, and neither is installed",
            "Set sequence_parallel: false (for MoE models also tensor_model_parallel_size: 1)",
        )
    if t.bf16 and t.fp16:
        raise InvalidConfigError("fp16", True, "bf16 and fp16 are both on", "Turn one off")
    if o.overlap_param_gather and not o.use_distributed_optimizer:
        raise InvalidConfigError(
            "overlap_param_gather",
            True,
            "needs the distributed optimizer",
            "Set use_distributed_optimizer: true",
        )
    fp32_only = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    for name in fp32_only:
        if getattr(o, name) != "fp32" and not o.use_precision_aware_optimizer:
            raise InvalidConfigError(
                name,
                getattr(o, name),
                "only the precision-aware optimizer keeps reduced-precision state",
                f"Set {name}: fp32",
            )
    if t.train_iters < 1:
        raise InvalidConfigError("train_iters", t.train_iters, "must be >= 1")
    decay_iters = o.lr_decay_iters or t.train_iters
    if o.lr_warmup_iters >= decay_iters:
        raise InvalidConfigError(
            "lr_warmup_iters",
            o.lr_warmup_iters,
            f"must be below lr_decay_iters (or train_iters when that is null) = {decay_iters}",
            "Shorten the warm-up or lengthen the run",
        )
    if m.num_experts is not None and m.num_experts % p.expert_model_parallel_size:
        raise InvalidConfigError(
            "num_experts",
            m.num_experts,
            f"not divisible by expert_model_parallel_size={p.expert_model_parallel_size}",
            "Choose EP among the divisors of num_experts",
        )
    if m.num_experts is None and p.expert_model_parallel_size > 1:
        raise InvalidConfigError(
            "expert_model_parallel_size",
            p.expert_model_parallel_size,
            "set for a model without experts",
            "Set num_experts, or expert_model_parallel_size: 1",
        )
    layers = cfg.model.num_layers
    if isinstance(m.moe_layer_freq, list) and len(m.moe_layer_freq) != layers:
        dense = min(next((i for i, v in enumerate(m.moe_layer_freq) if v), 0), layers - 1)
        raise InvalidConfigError(
            "moe_layer_freq",
            f"<{len(m.moe_layer_freq)} entries>",
            f"the pattern must have num_layers={layers} entries",
            f"Pass --moe_layer_freq 1 (every layer MoE) or a {layers}-entry pattern such as "
            f"([0]*{dense}+[1]*{layers - dense})",
        )
    if p.pipeline_model_parallel_size > 1 and p.pipeline_model_parallel_layout is None:
        uneven = (
            p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None
        )
        stages = p.pipeline_model_parallel_size * (p.virtual_pipeline_model_parallel_size or 1)
        if not uneven and cfg.model.num_layers % stages:
            raise InvalidConfigError(
                "num_layers",
                cfg.model.num_layers,
                f"not divisible by the {stages} pipeline stages",
                "Change num_layers or set pipeline_model_parallel_layout",
            )


def _data_parallel_size(cfg: PretrainConfig, world_size: int) -> int:
    p = cfg.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if world_size % model_parallel:
        raise InvalidConfigError(
            "tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size",
            model_parallel,
            f"does not divide the world size {world_size}",
            "Launch a multiple of that many ranks or change the parallel sizes",
        )
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    expert_parallel = p.expert_model_parallel_size * etp * p.pipeline_model_parallel_size
    if world_size % expert_parallel:
        raise InvalidConfigError(
            "expert_model_parallel_size",
            p.expert_model_parallel_size,
            f"expert_model_parallel_size * expert TP * PP = {expert_parallel} does not divide the world size "
            f"{world_size}",
            "Launch more ranks or lower expert_model_parallel_size",
        )
    return world_size // model_parallel


def _cuda_graph_impl(cfg: PretrainConfig) -> str:
    t = cfg.training
    if t.cuda_graph_impl is not None:
        return t.cuda_graph_impl
    if not t.external_cuda_graph:
        return "none"
    return "transformer_engine" if importlib.util.find_spec("transformer_engine") else "local"


def _notes(cfg: PretrainConfig) -> list[str]:
    notes = []
    defaults = KernelHints()
    hints = [
        f"{f.name}={getattr(cfg.kernel_hints, f.name)}"
        for f in dataclasses.fields(KernelHints)
        if getattr(cfg.kernel_hints, f.name) != getattr(defaults, f.name)
    ]
    if hints:
        notes.append(
            "kernel choices of Primus-Turbo / Transformer Engine that this trainer does not have; "
            "they do not change the math and are ignored: " + ", ".join(hints)
        )
    d = cfg.data
    paths = [
        n for n in ("train_data_path", "valid_data_path", "test_data_path", "data_path") if getattr(d, n)
    ]
    if d.mock_data and paths:
        notes.append(f"{', '.join(paths)} ignored: mock_data is on")
    for name in ("wandb_project", "tensorboard_dir"):
        if getattr(cfg.logging, name):
            notes.append(f"{name} is ignored: metrics go to the log and the final summary")
    if cfg.training.gradient_accumulation_fusion and not _has_fused_wgrad():
        notes.append(
            "gradient_accumulation_fusion turned off: apex's fused_weight_gradient_mlp_cuda is not installed"
        )
    return notes


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _has_fused_wgrad() -> bool:
    return _installed("fused_weight_gradient_mlp_cuda")
