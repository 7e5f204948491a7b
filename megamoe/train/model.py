"""The model: megatron-core ``TransformerConfig`` from our settings, ``GPTModel`` chunks, DDP wrapping,
and the MegaMoE switch (decided once, logged once with its reason).
"""

from __future__ import annotations

import copy
import importlib.util
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from megamoe.errors import InvalidConfigError
from megamoe.settings import EPSettings
from megamoe.train.schema import PretrainConfig
from megamoe.train.validate import RunPlan


@dataclass(frozen=True, kw_only=True)
class MoESwitch:
    """Which MoE block the layers get, and why (the reason is logged once on rank 0)."""

    use_mega_moe: bool
    reason: str
    options: Any
    """``megamoe.megatron.MegaMoEOptions`` handed to the layer spec."""


def params_dtype(cfg: PretrainConfig) -> torch.dtype:
    t = cfg.training
    return torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32


def padded_vocab_size(cfg: PretrainConfig, vocab_size: int) -> int:
    """Round the vocabulary up so the embedding splits evenly over TP (megatron's rule)."""
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(cfg: PretrainConfig, plan: RunPlan) -> Any:
    """A megatron-core ``TransformerConfig`` (``MLATransformerConfig`` for MLA) for ``cfg``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    m, moe, p, t = cfg.model, cfg.moe, cfg.parallel, cfg.training
    dtype = params_dtype(cfg)
    kwargs: dict[str, Any] = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        kv_channels=m.kv_channels,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        mtp_num_layers=m.mtp_num_layers or None,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        gradient_accumulation_fusion=plan.gradient_accumulation_fusion,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_layout=p.pipeline_model_parallel_layout,
        num_layers_in_first_pipeline_stage=p.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=p.decoder_last_pipeline_num_layers,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        context_parallel_size=p.context_parallel_size,
        sequence_parallel=p.sequence_parallel,
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        cuda_graph_impl=plan.cuda_graph_impl,
        cuda_graph_warmup_steps=t.cuda_graph_warmup_steps,
    )
    if t.cuda_graph_scope is not None:
        kwargs["cuda_graph_scope"] = t.cuda_graph_scope
    if moe.num_experts is not None:
        kwargs.update(
            num_moe_experts=moe.num_experts,
            moe_layer_freq=moe.moe_layer_freq,
            moe_ffn_hidden_size=moe.moe_ffn_hidden_size or kwargs["ffn_hidden_size"],
            moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
            moe_shared_expert_overlap=moe.moe_shared_expert_overlap,
            moe_router_topk=moe.moe_router_topk,
            moe_router_score_function=moe.moe_router_score_function,
            moe_router_pre_softmax=moe.moe_router_pre_softmax,
            moe_router_num_groups=moe.moe_router_num_groups,
            moe_router_group_topk=moe.moe_router_group_topk,
            moe_router_topk_scaling_factor=moe.moe_router_topk_scaling_factor,
            moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
            moe_aux_loss_coeff=moe.moe_aux_loss_coeff,
            moe_z_loss_coeff=moe.moe_z_loss_coeff,
            moe_input_jitter_eps=moe.moe_input_jitter_eps,
            moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=moe.moe_router_bias_update_rate,
            moe_router_dtype=moe.moe_router_dtype,
            moe_token_dispatcher_type=moe.moe_token_dispatcher_type,
            moe_grouped_gemm=moe.moe_grouped_gemm,
            moe_expert_capacity_factor=moe.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=moe.moe_pad_expert_input_to_capacity,
            moe_token_drop_policy=moe.moe_token_drop_policy,
            moe_layer_recompute=moe.moe_layer_recompute,
            moe_per_layer_logging=moe.moe_per_layer_logging,
        )
    cls = TransformerConfig
    if m.multi_latent_attention:
        cls = MLATransformerConfig
        kwargs.update(
            q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank,
            qk_head_dim=m.qk_head_dim,
            qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
            v_head_dim=m.v_head_dim,
            rotary_base=m.rotary_base,
            rotary_percent=m.rotary_percent,
            rotary_scaling_factor=m.rotary_scaling_factor,
            original_max_position_embeddings=m.original_max_position_embeddings,
            beta_fast=m.beta_fast,
            beta_slow=m.beta_slow,
            mscale=m.mscale,
            mscale_all_dim=m.mscale_all_dim,
        )
    try:
        return cls(**kwargs)
    except (ValueError, AssertionError, TypeError) as e:
        raise InvalidConfigError(
            "model",
            cls.__name__,
            f"megatron-core rejects the settings: {e}",
            "Fix the setting named in the message",
        ) from e


def _router_force_balancing(cfg: PretrainConfig) -> str | None:
    moe = cfg.moe
    return moe.moe_router_force_load_balancing_type if moe.moe_router_force_load_balancing else None


def ep_settings(cfg: PretrainConfig) -> EPSettings:
    """The EP settings: the config's ``turbo_mega_moe_*`` keys where set, else the environment's."""
    env = EPSettings.from_env()
    t = cfg.turbo
    symm = {
        "dispatch": t.turbo_mega_moe_symm_dispatch,
        "max_tokens": t.turbo_mega_moe_symm_max_tokens,
        "capacity_factor": t.turbo_mega_moe_symm_capacity_factor,
    }
    return EPSettings(
        transport=t.turbo_mega_moe_ep_transport or env.transport,
        symm=replace(env.symm, **{k: v for k, v in symm.items() if v is not None}),
    )


def decide_moe_switch(cfg: PretrainConfig, tconfig: Any) -> MoESwitch:
    """Ask the integration layer whether MegaMoE replaces megatron's MoELayer (it raises on settings
    MegaMoE cannot honour when it is requested)."""
    from megamoe.megatron import MegaMoEOptions, decide_mega_moe

    options = MegaMoEOptions(
        enabled=cfg.turbo.enable_primus_turbo and cfg.turbo.use_turbo_mega_moe,
        precision=cfg.turbo.turbo_mega_moe_precision,
        backend=cfg.turbo.turbo_mega_moe_backend,
        force_load_balancing=_router_force_balancing(cfg),
        ep=ep_settings(cfg),
    )
    if cfg.moe.num_experts is None:
        return MoESwitch(use_mega_moe=False, reason="the model has no MoE layers", options=options)
    decision = decide_mega_moe(tconfig, options)
    reason = decision.reason
    if not decision.use:  # which of megatron's expert modules the local spec builds
        reason += f"; experts {'GroupedMLP' if tconfig.moe_grouped_gemm else 'SequentialMLP'}"
    return MoESwitch(use_mega_moe=decision.use, reason=reason, options=options)


def layer_spec(cfg: PretrainConfig, tconfig: Any, switch: MoESwitch, vp_stage: int | None) -> Any:
    """The decoder block spec for one model chunk (local, non-TE modules)."""
    from megamoe.megatron import gpt_decoder_block_spec

    block = gpt_decoder_block_spec(
        tconfig, use_mega_moe=switch.use_mega_moe, options=switch.options, vp_stage=vp_stage
    )
    return _local_mla_attention(block) if cfg.model.multi_latent_attention else block


def _local_mla_attention(block: Any) -> Any:
    """Swap megatron-core's local core attention, which cannot build MLA, for :class:`SDPACoreAttention`.

    Without Transformer Engine, megatron-core 0.16's MLA module also believes TE is present (its
    import of megatron's TE wrappers succeeds, with mocks) and calls ``isinstance`` on a mock; its
    ``HAVE_TE`` flag is corrected here.
    """
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megamoe.train.attention import SDPACoreAttention

    if importlib.util.find_spec("transformer_engine") is None:
        mla.HAVE_TE = False

    block = copy.copy(block)
    layers = []
    for layer in block.layer_specs:
        attention = getattr(layer.submodules.self_attention, "submodules", None)
        if getattr(attention, "core_attention", None) is DotProductAttention:
            layer = copy.deepcopy(layer)
            layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        layers.append(layer)
    block.layer_specs = layers
    return block


def build_model_chunks(cfg: PretrainConfig, tconfig: Any, switch: MoESwitch, vocab_size: int) -> list[Any]:
    """One ``GPTModel`` per virtual pipeline stage held by this rank (one without VPP)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    vpp = tconfig.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp in range(vpp):
        vp_stage = vp if vpp > 1 else None
        spec = layer_spec(cfg, tconfig, switch, vp_stage)
        mtp_spec = None
        if tconfig.mtp_num_layers:
            mtp_spec = get_gpt_mtp_block_spec(tconfig, spec, use_transformer_engine=False, vp_stage=vp_stage)
        chunks.append(
            GPTModel(
                config=tconfig,
                transformer_layer_spec=spec,
                vocab_size=padded_vocab_size(cfg, vocab_size),
                max_sequence_length=cfg.model.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
                position_embedding_type=cfg.model.position_embedding_type,
                rotary_percent=cfg.model.rotary_percent,
                rotary_base=cfg.model.rotary_base,
                rope_scaling=cfg.model.rotary_scaling and not cfg.model.multi_latent_attention,
                rope_scaling_factor=cfg.model.rotary_scaling_factor,
                mtp_block_spec=mtp_spec,
                vp_stage=vp_stage,
            )
        )
    return chunks


def symm_max_tokens(cfg: PretrainConfig) -> int:
    """Tokens per rank the symmetric workspace holds: the EP settings' ``max_tokens``
    (``turbo_mega_moe_symm_max_tokens``), else what one MoE layer sees per micro-batch (the sequence
    split over CP, times the micro-batch; MegaMoE runs at TP = 1, so sequence parallelism splits nothing)."""
    t = cfg.training
    return (
        ep_settings(cfg).symm.max_tokens
        or t.seq_length // cfg.parallel.context_parallel_size * t.micro_batch_size
    )


def allocate_symm_workspaces(cfg: PretrainConfig, chunks: list[Any]) -> int:
    """Give the MegaMoE layers whose tokens move through symmetric memory their workspace, sized from
    the config (:func:`symm_max_tokens`) before the first step; layers of one shape share one.
    Returns how many layers got one (a collective per EP group)."""
    from megamoe.megatron.moe_block import MegaMoEBlock

    max_tokens = symm_max_tokens(cfg)
    blocks = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MegaMoEBlock)]
    count = 0
    for block in blocks:
        if block.experts.uses_symmetric_memory():
            block.experts.allocate_workspace(max_tokens=max_tokens, topk=cfg.moe.moe_router_topk)
            count += 1
    return count


def wrap_ddp(cfg: PretrainConfig, tconfig: Any, chunks: list[Any]) -> list[Any]:
    """megatron DDP per chunk: contiguous grad buffers, bucketed (overlapped) reduce, distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    o = cfg.optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=o.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=o.overlap_grad_reduce,
        overlap_param_gather=o.overlap_param_gather,
        use_distributed_optimizer=o.use_distributed_optimizer,
        bucket_size=o.ddp_bucket_size,
    )
    if torch.cuda.is_available():
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    return [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def count_parameters(chunks: list[Any]) -> int:
    """Parameters held by this rank (all chunks)."""
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
