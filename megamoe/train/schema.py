"""The typed settings of `train pretrain`, one dataclass per concern, with Megatron/Primus field names.

Experiment YAMLs and CLI overrides are flat (``num_layers: 4``, ``--lr 1e-4``), as in Primus; every
flat key belongs to exactly one section below, so :func:`section_of` routes it and an unknown key is
an error. Defaults are megatron-core's (or Primus's where the key is Primus's own). Keys that only
pick a GPU kernel in Primus/Transformer Engine are in :class:`KernelHints`: accepted so Primus
configs load, logged when set, and never change the math.

This module is long (~400 lines) because it is the whole reference of accepted keys; it holds no logic
beyond the section routing.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

LayerPattern = int | list[int]
"""``moe_layer_freq``: an int (every n-th layer is MoE) or a 0/1 list; strings such as
``([0]*3+[1]*58)`` are evaluated (safely) by :mod:`megamoe.train.convert`."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the GPT decoder (the model preset's keys)."""

    num_layers: int = 2
    """Decoder layers (MTP layers not included)."""
    hidden_size: int = 64
    ffn_hidden_size: int | None = None
    """Dense MLP width; None means 4 * hidden_size."""
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (used when group_query_attention is true)."""
    group_query_attention: bool = False
    kv_channels: int | None = None
    """Per-head dimension; None means hidden_size / num_attention_heads."""
    max_position_embeddings: int = 4096
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    rotary_scaling_factor: float = 1.0
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    """Gated SiLU MLPs (SwiGLU), as every shipped model uses."""
    add_bias_linear: bool = False
    """Bias in linear layers; megatron-core's MoE experts crash in training with it, keep false."""
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    vocab_size: int | None = None
    """Rows of the embedding before padding to make_vocab_size_divisible_by * TP. Real data: null means
    the tokenizer's vocabulary, a set value must be at least that. Mock data: its token ids (null: 128)."""
    make_vocab_size_divisible_by: int = 128
    tokenizer_type: str | None = None
    """Real data: ``HuggingFaceTokenizer``, ``SentencePieceTokenizer`` or ``NullTokenizer`` (local files
    only). Mock data ignores it."""
    tokenizer_model: str | None = None
    """A HuggingFace tokenizer directory (``tokenizer.json``) or a SentencePiece ``.model`` file."""
    multi_latent_attention: bool = False
    """DeepSeek MLA attention (q/kv low-rank projections)."""
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rotary_scaling: bool = False
    """Llama-3-style RoPE scaling by rotary_scaling_factor (MLA models use YaRN with that factor instead)."""
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mtp_num_layers: int | None = None
    """Multi-token-prediction layers (DeepSeek-V3 uses 1); None or 0 turns MTP off."""
    mtp_loss_scaling_factor: float = 0.1


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Mixture-of-experts layers and their router (megatron-core ``moe_*`` semantics)."""

    num_experts: int | None = None
    """Routed experts per MoE layer; None makes every layer dense."""
    moe_layer_freq: LayerPattern = 1
    """Which layers are MoE: n means every n-th, or a 0/1 list such as ``([0]*3+[1]*58)``."""
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the always-on shared expert; None means no shared expert."""
    moe_shared_expert_overlap: bool = False
    moe_router_topk: int = 2
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: int | None = None
    """Expert groups for group-limited routing (DeepSeek-V3: 8)."""
    moe_router_group_topk: int | None = None
    """Groups each token may route to (DeepSeek-V3: 4)."""
    moe_router_topk_scaling_factor: float | None = None
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"
    ] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_input_jitter_eps: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    moe_grouped_gemm: bool = False
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_router_force_load_balancing: bool = False
    """Benchmark mode: routing ignores the learned scores so every expert gets a similar load."""
    moe_router_force_load_balancing_type: Literal["even", "uniform"] = "even"
    """``uniform``: random router logits (megatron-core); ``even``: round-robin slots (Primus)."""
    moe_layer_recompute: bool = False
    moe_per_layer_logging: bool = False


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Process layout; DP is what is left: world / (TP * PP * CP)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_model_parallel_layout: str | None = None
    """Stages as megatron-core layout text, e.g. ``Ett|tttt|tttL`` (E embedding, t layer, L loss)."""
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """Iterations, batch geometry, precision, recompute and CUDA graphs."""

    train_iters: int = 10
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    """Samples per optimizer step; None means micro_batch_size * DP (one micro-batch)."""
    seq_length: int = 128
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    fp8: str | None = None
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    recompute_layer_ids: list[int] | None = None
    """Primus-only per-layer recompute list; megatron-core has no such switch, so only null is accepted."""
    external_cuda_graph: bool = False
    """Capture each transformer layer in a CUDA graph (GPU only)."""
    cuda_graph_impl: Literal["none", "local", "transformer_engine"] | None = None
    """None: ``transformer_engine`` if it is installed, else ``local`` (when a graph is asked for)."""
    cuda_graph_scope: str | None = None
    """What a graph captures (megatron-core values: ``full`` = the whole layer, ``attn``, ``moe``...)."""
    cuda_graph_warmup_steps: int = 3
    eval_iters: int = 0
    """Global batches of validation data per evaluation (0: no evaluation)."""
    eval_interval: int | None = None
    """Evaluate every this many iterations; null evaluates only at the end of training."""
    exit_interval: int | None = None
    """Save and stop after this iteration (for tests and preemption drills); None runs to train_iters."""
    exit_duration_in_mins: float | None = None
    """Save and stop at the first iteration boundary after this many minutes of the run."""
    exit_signal_handler: bool = True
    """SIGTERM and SIGUSR1 save a checkpoint at the next iteration boundary and exit with status 75
    (preempted, resumable); SIGINT stops after the current step without saving (status 130)."""
    gradient_accumulation_fusion: bool = False
    """Fused wgrad accumulation needs apex's CUDA extension; turned off (logged) when it is absent."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Optimizer, LR/WD schedule, gradient clipping, DDP buckets and overlap."""

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_iters: int | None = None
    """None means train_iters."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "cosine"
    weight_decay: float = 0.01
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    override_opt_param_scheduler: bool = False
    """On resume, use the config's LR/WD schedule instead of the checkpoint's (wins over the next key)."""
    use_checkpoint_opt_param_scheduler: bool = True
    """On resume, use the checkpoint's LR/WD schedule (megatron-core's default); with both false a
    schedule that differs from the checkpoint's stops the run."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    """Needs the distributed optimizer."""
    ddp_bucket_size: int | None = None
    accumulate_allreduce_grads_in_fp32: bool = True
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    main_params_dtype: Literal["fp32", "fp16"] = "fp32"
    exp_avg_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    exp_avg_sq_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Training data: megatron indexed datasets (``train prepare-data``) or megatron-core's mock GPT data."""

    mock_data: bool = True
    """Random tokens for benchmarks; false reads data_path (or the per-split paths)."""
    train_data_path: str | None = None
    """A prefix or blend for training only (with valid_data_path / test_data_path, instead of data_path)."""
    valid_data_path: str | None = None
    test_data_path: str | None = None
    data_path: str | None = None
    """A dataset prefix (``data/corpus_text_document``) or a blend ``"0.7 a 0.3 b"``, divided by split."""
    split: str = "969,30,1"
    """Train, validation and test shares of data_path's documents."""
    data_cache_path: str | None = None
    """Where megatron-core caches its dataset indices; null means ``<workspace>/data_cache``."""
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    num_workers: int = 0


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """megatron-core distributed checkpoints (``torch_dist``) and automatic resume."""

    save: str | None = None
    """Checkpoint directory; None means ``<workspace>/<work_group>/<user_name>/<exp_name>/checkpoints``."""
    load: str | None = None
    """Resume directory; None means the save directory (resume from its latest checkpoint, if any)."""
    save_interval: int | None = None
    """Save every n iterations; None saves only at the end (unless disable_last_saving)."""
    disable_last_saving: bool = False
    auto_continue_train: bool = True
    """Resume from the latest checkpoint in ``load`` when there is one."""
    finetune: bool = False
    """Load weights only and start at iteration 0."""
    no_load_optim: bool | None = None
    no_load_rng: bool | None = None
    no_save_optim: bool | None = None
    no_save_rng: bool | None = None
    strict_resume: bool = False
    """Stop when the newest checkpoint is incomplete instead of resuming from the one before it."""
    overwrite_checkpoints: bool = False
    """Start at iteration 0 and replace the checkpoints already in ``save``; without it a run that would
    overwrite them stops at start-up."""
    ckpt_format: Literal["torch_dist", "torch"] = "torch_dist"
    """Only ``torch_dist`` (megatron-core dist_checkpointing) is implemented."""
    async_save: bool = False


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """What is printed per iteration, and the progress bar."""

    log_interval: int = 1
    progress_bar: bool = True
    """A tqdm bar on rank 0 (stderr)."""
    stderr_sink_level: str = "INFO"
    log_avg_skip_iterations: int = 0
    """Iterations (warm-up) left out of the summary's averages."""
    log_avg_reset_interval: int = 0
    wandb_project: str | None = None
    """Log to Weights & Biases (offline mode) under this project, when ``wandb`` is installed."""
    wandb_exp_name: str | None = None
    """The W&B run's name; null means exp_name."""
    wandb_save_dir: str | None = None
    """Where W&B writes its offline run; null means ``<output dir>/wandb``."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars (losses, lr, grad norm, throughput, memory, validation) here."""


@dataclass(kw_only=True, slots=True)
class TurboConfig:
    """The MegaMoE switch (Primus-Turbo names)."""

    enable_primus_turbo: bool = False
    use_turbo_mega_moe: bool = False
    """Replace megatron's MoELayer by the fused MegaMoE layer (needs enable_primus_turbo, TP=1)."""
    turbo_mega_moe_precision: Literal["bf16", "mxfp8", "fp8"] = "bf16"
    """The expert GEMMs' number format; parameters stay bf16. ``mxfp8``: OCP MX (docs/mxfp8.md);
    ``fp8``: DeepSeek-V3's blockwise FP8 (docs/fp8.md)."""
    turbo_mega_moe_backend: Literal["auto", "reference", "triton", "primus_turbo"] = "auto"
    turbo_mega_moe_ep_transport: Literal["symm", "nccl"] | None = None
    """How tokens move at EP > 1 (Triton backends): ``symm`` fuses the exchange into the grouped GEMMs
    over symmetric memory (one node), ``nccl`` runs all-to-all around them; null: MEGAMOE_EP_TRANSPORT,
    else symm on CUDA (nccl for fp8, whose symm path has not run on GPUs yet)."""
    turbo_mega_moe_symm_dispatch: Literal["push", "pull", "broadcast"] | None = None
    """The fused path's row movement; null: MEGAMOE_SYMM_DISPATCH, else broadcast at EP=2, push above."""
    turbo_mega_moe_symm_max_tokens: int | None = None
    """Tokens per rank the symmetric workspace holds; null: MEGAMOE_SYMM_MAX_TOKENS, else the largest
    count at the first step."""
    turbo_mega_moe_symm_capacity_factor: float | None = None
    """Routed rows a rank's pool holds, in balanced shares (``.inf``: the worst case); null:
    MEGAMOE_SYMM_CAPACITY, else 2."""


@dataclass(kw_only=True, slots=True)
class KernelHints:
    """Primus/ROCm/TE kernel choices: accepted so Primus configs load, logged when set, no effect here."""

    use_turbo_attention: bool = False
    use_turbo_grouped_mlp: bool = False
    use_turbo_rms_norm: bool = False
    use_turbo_deepep: bool = False
    turbo_deepep_num_cu: int = 32
    turbo_sync_free_moe_stage: int = 0
    moe_use_fused_router_with_aux_score: bool = False
    moe_use_legacy_grouped_gemm: bool = False
    moe_enable_deepep: bool = False
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    enable_experimental: bool = False
    apply_rope_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"
    cross_entropy_loss_fusion: bool = False
    use_flash_attn: bool = False
    masked_softmax_fusion: bool = False
    bias_swiglu_fusion: bool = False
    attention_backend: str = "auto"


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "turbo": TurboConfig,
    "kernel_hints": KernelHints,
}


@dataclass(kw_only=True, slots=True)
class PretrainConfig:
    """Everything `train pretrain` reads: the experiment's identity plus one object per concern."""

    work_group: str = "megamoe"
    user_name: str = "user"
    exp_name: str = "pretrain"
    workspace: str = "./output"
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    turbo: TurboConfig = field(default_factory=TurboConfig)
    kernel_hints: KernelHints = field(default_factory=KernelHints)

    @property
    def output_dir(self) -> str:
        """``workspace/work_group/user_name/exp_name``, as in Primus."""
        return "/".join((self.workspace.rstrip("/"), self.work_group, self.user_name, self.exp_name))

    def params(self) -> dict[str, Any]:
        """The flat ``key: value`` view (what overrides and ``--export_config`` use)."""
        flat: dict[str, Any] = {}
        for name in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat


IDENTITY_KEYS = ("work_group", "user_name", "exp_name", "workspace")


@functools.cache
def section_of() -> dict[str, str]:
    """Flat key -> section name; the key set is the whole vocabulary of experiment params."""
    owner: dict[str, str] = {}
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in owner, f"{f.name} is defined in {owner.get(f.name)} and {name}"
            owner[f.name] = name
    return owner
