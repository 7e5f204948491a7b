"""Tiny megatron-core GPT models with MoE, built on CPU ranks, for the parity tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F


def setup_megatron(ep: int = 1, pp: int = 1) -> None:
    """parallel_state over the already-initialised gloo world, and the CPU compatibility layer."""
    from megatron.core import parallel_state as ps

    from megamoe.megatron import apply_cpu_compat

    ps.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    apply_cpu_compat()


def moe_config(**overrides: Any):
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=12,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32",
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
    )
    fields.update(overrides)
    import torch.distributed as dist

    fields.setdefault("expert_model_parallel_size", 1)
    cfg = TransformerConfig(**fields)
    assert dist.is_initialized()
    return cfg


def build_gpt(cfg, *, mega: bool, seed: int = 1234, force: str | None = None):
    from megatron.core.models.gpt import GPTModel

    from megamoe.megatron import MegaMoEOptions, gpt_decoder_block_spec

    torch.manual_seed(seed)
    options = MegaMoEOptions(enabled=mega, backend="reference", force_load_balancing=force)
    spec = gpt_decoder_block_spec(cfg, use_mega_moe=mega, options=options)
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type="rope",
    )


def batch(seed: int, *, batch_size: int = 2, seq: int = 8):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (batch_size, seq), generator=g)
    labels = torch.randint(0, 64, (batch_size, seq), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch_size, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril().logical_not()
    return tokens, position_ids, mask, labels


def expert_weights_of_baseline(model) -> dict[str, torch.Tensor]:
    """Stack SequentialMLP's per-expert weights into MegaMoE's [G, 2I, H] / [G, H, I] layout, by layer."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "local_experts"):
            layer = name.rsplit(".experts", 1)[0]
            out[f"{layer}.experts.fc1.weight"] = torch.stack(
                [e.linear_fc1.weight for e in module.local_experts]
            )
            out[f"{layer}.experts.fc2.weight"] = torch.stack(
                [e.linear_fc2.weight for e in module.local_experts]
            )
    return out


def replace(cfg, **changes):
    return dataclasses.replace(cfg, **changes)
