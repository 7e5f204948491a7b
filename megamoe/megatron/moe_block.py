"""``MegaMoEBlock``: the drop-in replacement of megatron-core's ``MoELayer`` inside a ``TransformerLayer``.

It keeps megatron's contracts: ``forward(hidden_states [S, B, H]) -> (out, None)``; expert weights
are tagged ``allreduce=False`` so DDP reduces them over expert-DP and the optimizer puts them in its
expert group; the aux loss is attached with megatron's ``MoEAuxLossAutoScaler`` (so the schedules'
loss scale applies) and logged in megatron's aux-loss tracker under ``load_balancing_loss``.

Parameters are initialised in megatron's order (router, then each expert's fc1 and fc2, then the
shared expert) with megatron's init methods, so a MegaMoE model and a MoELayer model built from the
same seed start from the same weights.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import sharded_state_dict_default
from torch import Tensor

from megamoe.errors import UnsupportedSettingError
from megamoe.layer import MegaMoEExperts
from megamoe.megatron.options import MegaMoEOptions
from megamoe.router import MegaMoERouter, RouterConfig

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def router_config_from(config, options: MegaMoEOptions) -> RouterConfig:
    """Our router settings from megatron's ``TransformerConfig`` (field by field, same meaning)."""
    aux_coeff = config.moe_aux_loss_coeff if config.moe_router_load_balancing_type == "aux_loss" else 0.0
    return RouterConfig(
        num_experts=config.num_moe_experts,
        topk=config.moe_router_topk,
        score_function=config.moe_router_score_function,
        pre_softmax=config.moe_router_pre_softmax,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        topk_scaling_factor=config.moe_router_topk_scaling_factor,
        aux_loss_coeff=float(aux_coeff or 0.0),
        force_load_balancing=options.force_load_balancing,
        dtype=_ROUTER_DTYPES[config.moe_router_dtype] or config.params_dtype,
    )


def _megatron_init_(weight: Tensor, init_method, config, *, expert: bool) -> None:
    """Initialise one [out, in] matrix the way megatron's linear layers do (CPU or GPU path)."""
    with torch.no_grad():
        if config.use_cpu_initialization:
            master = torch.empty(weight.shape, dtype=torch.float32)
            init_method(master)
            weight.copy_(master.to(weight.dtype))
        elif expert:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init_method(weight)
        else:
            with get_cuda_rng_tracker().fork():
                init_method(weight)


class MegaMoEBlock(MegatronModule):
    """Router + fused expert path (+ megatron's shared expert), for megatron-core ``TransformerLayer``."""

    def __init__(
        self,
        config,
        submodules=None,
        pg_collection: ProcessGroupCollection | None = None,
        options: MegaMoEOptions | None = None,
        **unused,
    ) -> None:
        super().__init__(config=config)
        pg = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        self.options = options or MegaMoEOptions(enabled=True)
        self.ep_group = pg.ep
        self.expert_dp_group = pg.expt_dp
        self.tp_cp_group = pg.tp_cp
        self.layer_number: int | None = None
        device = None if config.use_cpu_initialization else torch.cuda.current_device()

        self.router = MegaMoERouter(
            router_config_from(config, self.options),
            config.hidden_size,
            reduce_group=pg.tp_cp,
            attach=self._attach_aux_loss,
            weight_dtype=config.params_dtype,  # megatron: fp32 init, then params_dtype
            init_method=config.init_method if config.perform_initialization else (lambda w: None),
        )

        ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
        self.experts = MegaMoEExperts(
            num_experts=config.num_moe_experts,
            hidden_size=config.hidden_size,
            ffn_hidden_size=ffn,
            ep_group=self.ep_group,
            dtype=config.params_dtype,
            device=device,
            backend=self.options.backend,
            precision=self.options.precision,
            ep_settings=self.options.ep,
        )
        if config.perform_initialization:
            for e in range(self.experts.num_local_experts):
                _megatron_init_(self.experts.fc1_weight[e], config.init_method, config, expert=True)
                _megatron_init_(
                    self.experts.fc2_weight[e], config.output_layer_init_method, config, expert=True
                )

        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = build_module(
                submodules.shared_experts, config=config, pg_collection=pg, gate=False
            )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Distributed-checkpoint layout: expert weights are shards of ``[E, ...]`` along the expert axis.

        Rank r of the EP group holds experts ``[r*G, (r+1)*G)``; the copies on other expert-DP ranks
        are replicas. The router and the shared expert are replicated like any dense module.
        """
        state = {}
        for name in ("router", "shared_experts"):
            module = getattr(self, name)
            if module is not None:
                state.update(
                    sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata)
                )
        axis = len(sharded_offsets)
        expert_shard = (axis, self.ep_group.rank(), self.ep_group.size())
        for name, weight in (
            ("fc1.weight", self.experts.fc1_weight),
            ("fc2.weight", self.experts.fc2_weight),
        ):
            key = f"{prefix}experts.{name}"
            state[key] = ShardedTensor.from_rank_offsets(
                key,
                weight,
                *sharded_offsets,
                expert_shard,
                replica_id=(0, 0, self.expert_dp_group.rank()),
                prepend_axis_num=axis,
            )
        return state

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def _attach_aux_loss(self, topk_weights: Tensor, aux_loss: Tensor) -> Tensor:
        coeff = self.router.cfg.aux_loss_coeff
        if self.layer_number is not None:
            num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
            save_to_aux_losses_tracker(
                "load_balancing_loss",
                aux_loss / coeff,
                self.layer_number,
                num_layers,
                reduce_group=self.tp_cp_group,
            )
        if self.config.calculate_per_token_loss:
            aux_loss = aux_loss * topk_weights.shape[0]
        return MoEAuxLossAutoScaler.apply(topk_weights, aux_loss)

    def forward(
        self, hidden_states: Tensor, padding_mask: Tensor | None = None, **unused
    ) -> tuple[Tensor, None]:
        if padding_mask is not None:
            raise UnsupportedSettingError(
                "padding_mask", "given", "MegaMoE routes every token", "Pack sequences without padding tokens"
            )
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, shape[-1])
        routing = self.router(x_TH)
        out = self.experts(x_TH, routing.topk_idx, routing.topk_weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden_states)
            out = out + shared.reshape(-1, shape[-1])
        return out.view(shape), None
