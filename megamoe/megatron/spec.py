"""GPT layer specs whose MoE block is MegaMoE, and forced routing for megatron's own MoELayer.

:func:`gpt_decoder_block_spec` starts from megatron-core's local (non-Transformer-Engine) GPT block
spec, which honours ``moe_layer_freq``, and swaps the ``mlp`` of every MoE layer. Forced load
balancing is applied to *both* paths — MegaMoE's router and megatron's ``TopKRouter`` — so an A/B
comparison routes the same way (Primus's ``even`` mode silently reached only one path).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import apply_random_logits
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from megamoe.megatron.moe_block import MegaMoEBlock
from megamoe.megatron.options import MegaMoEOptions


@dataclass
class MegaMoESpec:
    """A spec that ``build_module`` instantiates as ``module(**params, submodules=..., **kwargs)``.

    Deliberately not a ``ModuleSpec``: ``TransformerLayer`` warns about unknown ``ModuleSpec`` MLPs
    and would not pass ``pg_collection`` anyway (the block falls back to megatron's global groups).
    """

    module: type = MegaMoEBlock
    params: dict[str, Any] = field(default_factory=dict)
    submodules: MoESubmodules | None = None


class EvenTopKRouter(TopKRouter):
    """megatron's router with Primus's ``even`` forced balancing: k-th weight of token t to expert (t*K+k) % E."""

    def routing(self, logits, *args, **kwargs):
        probs, routing_map = super().routing(logits, *args, **kwargs)
        num_tokens, num_experts = probs.shape
        weights, _ = torch.topk(probs, k=self.topk, dim=1)
        slots = torch.arange(num_tokens * self.topk, device=probs.device).view(num_tokens, self.topk)
        experts = slots % num_experts
        even_probs = torch.zeros_like(probs).scatter(1, experts, weights)
        even_map = torch.zeros_like(routing_map).scatter(1, experts, True)
        return even_probs, even_map


class UniformTopKRouter(TopKRouter):
    """megatron's router on random logits (straight-through gradient), whatever the config flag says."""

    def routing(self, logits, *args, **kwargs):
        return super().routing(apply_random_logits(logits), *args, **kwargs)


_FORCED_ROUTERS = {"even": EvenTopKRouter, "uniform": UniformTopKRouter}


def _is_moe_spec(spec: Any) -> bool:
    return isinstance(spec, ModuleSpec) and spec.module is MoELayer


def gpt_decoder_block_spec(
    config,
    *,
    use_mega_moe: bool,
    options: MegaMoEOptions,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
):
    """``transformer_layer_spec`` for ``GPTModel``: local layers, MoE blocks per ``moe_layer_freq``.

    ``vp_stage``/``pp_rank`` select the layers of one (virtual) pipeline stage, as in megatron-core.
    """
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=False,
        normalization=config.normalization,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    block = copy.copy(block)
    layers = []
    for layer in block.layer_specs:
        mlp = layer.submodules.mlp
        if _is_moe_spec(mlp):
            layer = copy.deepcopy(layer)
            if use_mega_moe:
                layer.submodules.mlp = MegaMoESpec(params={"options": options}, submodules=mlp.submodules)
            elif options.force_load_balancing:
                layer.submodules.mlp.submodules.router = _FORCED_ROUTERS[options.force_load_balancing]
        layers.append(layer)
    block.layer_specs = layers
    return block
