"""SDPACoreAttention (local MLA core attention) against the attention formula written out."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megamoe.train.attention import SDPACoreAttention

S, B, HEADS, DK, DV = 5, 2, 3, 6, 4


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)
    return out.reshape(S, B, HEADS * DV)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_core_attention_matches_causal_attention_with_distinct_value_dim(scale: float | None) -> None:
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=HEADS, attention_dropout=0.0)
    attention = SDPACoreAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale, k_channels=DK,
                                  v_channels=DV)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(S, B, HEADS, DK, generator=g) for _ in range(2))
    v = torch.randn(S, B, HEADS, DV, generator=g)
    out = attention(q, k, v, attention_mask=None)
    torch.testing.assert_close(out, _reference(q, k, v, scale or 1 / math.sqrt(DK)))
