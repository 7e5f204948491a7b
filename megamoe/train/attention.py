"""Core attention by ``torch.nn.functional.scaled_dot_product_attention`` for MLA without Transformer Engine.

megatron-core 0.16's local ``DotProductAttention`` takes no ``k_channels`` / ``v_channels``, so its
local MLA spec (query/key head dim 192 != value head dim 128 in DeepSeek-V3) cannot be built; only
TE's attention can. This module is the local stand-in: same constructor keywords, same
``[s, b, heads, dim]`` inputs and ``[s, b, heads * v_dim]`` output, causal masking, attention
dropout, and the softmax scale MLA computes (YaRN's mscale included).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """``DotProductAttention``'s interface, with separate key and value head dims."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """q/k ``[s, b, h, dk]``, v ``[s, b, h, dv]`` -> ``[s, b, h * dv]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPACoreAttention: packed sequences and attention bias need TE attention"
            )
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if causal or attention_mask is None else attention_mask.logical_not(),
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
