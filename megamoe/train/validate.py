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
from megamoe.train.indexed import check_prefix, parse_blend, parse_split
from megamoe.train.schema import KernelHints, PretrainConfig
from megamoe.train.tokenizer import check_tokenizer


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What the config means on this world: sizes, micro-batches, folders, and notes to log once."""

    world_size: int
    data_parallel_size: int
    num_microbatches: int
    global_batch_size: int
    save_dir: Path
    load_dir: Path
    data_cache_dir: Path
    cuda_graph_impl: str
    gradient_accumulation_fusion: bool
    notes: tuple[str, ...] = field(default=())


def plan_run(cfg: PretrainConfig, *, world_size: int, has_cuda: bool) -> RunPlan:
    """Validate ``cfg`` for ``world_size`` ranks; raise the first problem with its setting's name."""
    _check_ranges(cfg)
    _check_unsupported(cfg, has_cuda)
    _check_consistency(cfg)
    _check_data(cfg)
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
    load = Path(cfg.checkpoint.load) if cfg.checkpoint.load else save
    _check_workspace(cfg, save, load)
    return RunPlan(
        world_size=world_size,
        data_parallel_size=dp,
        num_microbatches=gbs // (t.micro_batch_size * dp),
        global_batch_size=gbs,
        save_dir=save,
        load_dir=load,
        data_cache_dir=Path(cfg.data.data_cache_path or f"{cfg.workspace.rstrip('/')}/data_cache"),
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
            m.moe_grouped_gemm and importlib.util.find_spec("grouped_gemm") is None,
            "moe_grouped_gemm",
            True,
            "megatron-core's grouped-GEMM experts (GroupedMLP, its expert module without Transformer "
            "Engine) need the grouped_gemm package, which is not installed",
            "Install grouped_gemm, put benchmarks/grouped_gemm_shim first on PYTHONPATH (the same call on "
            "torch._grouped_mm), set moe_grouped_gemm: false, or use_turbo_mega_moe: true for the fused path",
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


def resumes_in_place(cfg: PretrainConfig, save: Path, load: Path) -> bool:
    """The one rule for a save folder that already holds checkpoints: a run continues them (resume
    from that same folder) or, with overwrite_checkpoints, replaces them; anything else stops."""
    c = cfg.checkpoint
    return c.auto_continue_train and not c.finetune and not c.overwrite_checkpoints and load == save


def _check_workspace(cfg: PretrainConfig, save: Path, load: Path) -> None:
    tracker = save / "latest_checkpointed_iteration.txt"
    if cfg.checkpoint.overwrite_checkpoints or not tracker.is_file() or resumes_in_place(cfg, save, load):
        return
    raise InvalidConfigError(
        "save",
        str(save),
        f"already holds checkpoints (up to iteration {tracker.read_text().strip()}) that this run, starting "
        "at iteration 0, would overwrite",
        "Resume them (auto_continue_train: true), save elsewhere (--save DIR or a new --exp_name), or pass "
        "--overwrite_checkpoints true to replace them",
    )


def _check_data(cfg: PretrainConfig) -> None:
    """Real data: the tokenizer's files, the blends and every prefix's .bin/.idx pair, by name."""
    d, m = cfg.data, cfg.model
    if d.mock_data:
        return
    per_split = {
        n: getattr(d, n) for n in ("train_data_path", "valid_data_path", "test_data_path") if getattr(d, n)
    }
    if d.data_path and per_split:
        raise InvalidConfigError(
            "data_path",
            d.data_path,
            f"given together with {', '.join(per_split)}",
            "Use data_path (with split) or the per-split paths",
        )
    if not d.data_path and "train_data_path" not in per_split:
        raise InvalidConfigError(
            "data_path",
            None,
            "mock_data is false but no data is given",
            "Set data_path to a prefix made by `train prepare-data` (or a blend '0.7 a 0.3 b'), or mock_data: true",
        )
    check_tokenizer(m.tokenizer_type, m.tokenizer_model, m.vocab_size)
    blends = {"data_path": d.data_path} if d.data_path else per_split
    if d.data_path:
        parse_split(d.split)
    for setting, text in blends.items():
        for prefix in parse_blend(text, setting).prefixes:
            check_prefix(prefix, setting)


_POSITIVE = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by",
              "q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim", "original_max_position_embeddings"),
    "moe": ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_topk",
            "moe_router_num_groups", "moe_router_group_topk"),
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size"),
    "training": ("train_iters", "micro_batch_size", "global_batch_size", "seq_length", "eval_interval",
                 "exit_interval"),
    "optimizer": ("lr_decay_iters", "ddp_bucket_size"),
    "checkpoint": ("save_interval",),
    "logging": ("log_interval",),
    "turbo": ("turbo_mega_moe_symm_max_tokens", "turbo_mega_moe_symm_capacity_factor"),
}  # fmt: skip
"""Integer settings that must be >= 1 when set (null, where allowed, keeps its meaning)."""

_NON_NEGATIVE = {
    "model": ("qk_pos_emb_head_dim", "norm_epsilon", "init_method_std", "mtp_num_layers", "mtp_loss_scaling_factor"),
    "moe": ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_router_bias_update_rate",
            "moe_router_topk_scaling_factor", "moe_expert_capacity_factor"),
    "parallel": ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"),
    "training": ("eval_iters", "cuda_graph_warmup_steps", "recompute_num_layers", "exit_duration_in_mins"),
    "optimizer": ("lr", "min_lr", "lr_warmup_iters", "lr_warmup_init", "weight_decay", "start_weight_decay",
                  "end_weight_decay", "adam_eps", "clip_grad", "initial_loss_scale", "loss_scale"),
    "logging": ("log_avg_skip_iterations", "log_avg_reset_interval"),
    "data": ("num_workers",),
}  # fmt: skip
"""Numeric settings that must be >= 0 when set."""

_UNIT_INTERVAL = {
    "model": ("hidden_dropout", "attention_dropout", "rotary_percent"),
    "optimizer": ("adam_beta1", "adam_beta2", "sgd_momentum"),
}
"""Settings that are fractions: 0 <= value <= 1 (betas < 1)."""


def _check_ranges(cfg: PretrainConfig) -> None:
    """Every numeric setting against its range, before anything else reads it."""

    def values(table: dict[str, tuple[str, ...]]) -> list[tuple[str, float]]:
        out = []
        for section, names in table.items():
            for name in names:
                value = getattr(getattr(cfg, section), name)
                if value is not None and not isinstance(value, bool):
                    out.append((name, value))
        return out

    for name, value in values(_POSITIVE):
        if value < 1:
            raise InvalidConfigError(name, value, "must be >= 1", "Use a positive value")
    for name, value in values(_NON_NEGATIVE):
        if value < 0 or value != value:  # NaN fails too
            raise InvalidConfigError(name, value, "must be >= 0", "Use zero or a positive value")
    for name, value in values(_UNIT_INTERVAL):
        top_open = name.startswith(("adam_beta", "sgd_"))
        if not (0 <= value < 1 if top_open else 0 <= value <= 1):
            bound = "0 <= value < 1" if top_open else "0 <= value <= 1"
            raise InvalidConfigError(name, value, f"must satisfy {bound}", "Use a fraction")
    o = cfg.optimizer
    if o.lr == 0:
        raise InvalidConfigError(
            "lr", o.lr, "must be > 0: nothing would train", "Set a positive learning rate"
        )
    if o.min_lr > o.lr:
        raise InvalidConfigError("min_lr", o.min_lr, f"above lr={o.lr}", "Set min_lr <= lr")
    m = cfg.moe
    if m.num_experts is not None and m.moe_router_topk > m.num_experts:
        raise InvalidConfigError(
            "moe_router_topk",
            m.moe_router_topk,
            f"more than num_experts={m.num_experts}",
            "Lower moe_router_topk",
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
    if cfg.logging.wandb_project and not _installed("wandb"):
        notes.append(
            f"wandb_project={cfg.logging.wandb_project!r}: wandb is not installed, so nothing goes to W&B "
            "(pip install wandb); metrics go to training_log.jsonl"
            + (" and tensorboard_dir" if cfg.logging.tensorboard_dir else "")
        )
    if not d.mock_data and cfg.training.eval_iters == 0:
        notes.append("eval_iters=0: no validation loss is computed (set eval_iters and eval_interval)")
    if cfg.training.gradient_accumulation_fusion and not _has_fused_wgrad():
        notes.append(
            "gradient_accumulation_fusion turned off: apex's fused_weight_gradient_mlp_cuda is not installed"
        )
    return notes


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _has_fused_wgrad() -> bool:
    return _installed("fused_weight_gradient_mlp_cuda")
