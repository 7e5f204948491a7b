"""When MegaMoE replaces megatron-core's MoELayer, and which settings it refuses.

The switch is on when ``enable_primus_turbo`` and ``use_turbo_mega_moe`` are both set (Primus's flags).
A setting MegaMoE cannot honour is an error at build time — never a silent fallback to another path,
which would make an A/B comparison measure the wrong thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from megamoe.backends import BACKEND_NAMES, transport_name
from megamoe.errors import InvalidConfigError, UnsupportedSettingError
from megamoe.quant.precision import check_precision
from megamoe.router import check_force_load_balancing
from megamoe.settings import EPSettings

SUPPORTED_LOAD_BALANCING = ("aux_loss", "none")


@dataclass(kw_only=True, slots=True, frozen=True)
class MegaMoEOptions:
    """The MegaMoE knobs of a training config (Primus names in the comments)."""

    enabled: bool
    """``enable_primus_turbo and use_turbo_mega_moe``."""
    precision: Literal["bf16", "mxfp8", "fp8"] = "bf16"
    """``turbo_mega_moe_precision``: precision of the expert GEMMs; parameters stay bf16."""
    backend: str = "auto"
    force_load_balancing: Literal["even", "uniform"] | None = None
    """``moe_router_force_load_balancing_type`` when ``moe_router_force_load_balancing`` is on."""
    ep: EPSettings = field(default_factory=EPSettings)
    """How tokens move at EP > 1 (``turbo_mega_moe_ep_transport``, ``turbo_mega_moe_symm_*``)."""

    def __post_init__(self) -> None:
        check_precision(self.precision, setting="turbo_mega_moe_precision")
        if self.backend not in BACKEND_NAMES:
            raise InvalidConfigError(
                "backend", self.backend, "unknown", f"Use one of {', '.join(BACKEND_NAMES)}"
            )
        check_force_load_balancing(self.force_load_balancing)


@dataclass(frozen=True, slots=True)
class MegaMoEDecision:
    use: bool
    reason: str


def _is_swiglu(config) -> bool:
    return bool(config.gated_linear_unit) and config.activation_func is F.silu


def _unsupported(config) -> list[tuple[str, object, str]]:
    """(setting, value, remedy) for every setting of ``config`` MegaMoE cannot honour."""
    found: list[tuple[str, object, str]] = []

    def check(cond: bool, setting: str, value: object, remedy: str) -> None:
        if cond:
            found.append((setting, value, remedy))

    check(
        config.tensor_model_parallel_size > 1,
        "tensor_model_parallel_size",
        config.tensor_model_parallel_size,
        "MegaMoE is expert-parallel only: set tensor_model_parallel_size=1 (use expert/data parallelism)",
    )
    etp = getattr(config, "expert_tensor_parallel_size", 1) or 1
    check(etp > 1, "expert_tensor_parallel_size", etp, "Set expert_tensor_parallel_size=1")
    check(
        config.add_bias_linear,
        "add_bias_linear",
        True,
        "Set add_bias_linear=false (MoE experts take no bias)",
    )
    check(
        not _is_swiglu(config),
        "activation",
        "non-SwiGLU",
        "Set swiglu=true (gated_linear_unit with silu); MegaMoE fuses SwiGLU only",
    )
    check(
        config.moe_expert_capacity_factor is not None,
        "moe_expert_capacity_factor",
        config.moe_expert_capacity_factor,
        "Set moe_expert_capacity_factor=null (MegaMoE is dropless)",
    )
    check(
        bool(config.moe_pad_expert_input_to_capacity),
        "moe_pad_expert_input_to_capacity",
        True,
        "Set moe_pad_expert_input_to_capacity=false",
    )
    lb = config.moe_router_load_balancing_type
    check(
        isinstance(lb, list) or lb not in SUPPORTED_LOAD_BALANCING,
        "moe_router_load_balancing_type",
        lb,
        "Use 'aux_loss' (micro-batch aux loss) or 'none'; seq_aux_loss, global_aux_loss and sinkhorn are not fused",
    )
    check(
        bool(config.moe_z_loss_coeff),
        "moe_z_loss_coeff",
        config.moe_z_loss_coeff,
        "Set moe_z_loss_coeff=null",
    )
    check(
        config.moe_input_jitter_eps is not None,
        "moe_input_jitter_eps",
        config.moe_input_jitter_eps,
        "Set moe_input_jitter_eps=null",
    )
    check(
        bool(config.moe_router_enable_expert_bias),
        "moe_router_enable_expert_bias",
        True,
        "Set moe_router_enable_expert_bias=false and use moe_aux_loss_coeff for balancing",
    )
    check(
        config.moe_router_score_function not in ("softmax", "sigmoid"),
        "moe_router_score_function",
        config.moe_router_score_function,
        "Use 'softmax' or 'sigmoid'",
    )
    check(
        bool(config.moe_shared_expert_gate),
        "moe_shared_expert_gate",
        True,
        "Set moe_shared_expert_gate=false",
    )
    check(
        bool(getattr(config, "moe_apply_probs_on_input", False)),
        "moe_apply_probs_on_input",
        True,
        "Set moe_apply_probs_on_input=false",
    )
    check(
        getattr(config, "moe_router_topk_limited_devices", None) is not None,
        "moe_router_topk_limited_devices",
        getattr(config, "moe_router_topk_limited_devices", None),
        "Use moe_router_num_groups / moe_router_group_topk for device-limited routing",
    )
    check(
        bool(getattr(config, "moe_layer_recompute", False)),
        "moe_layer_recompute",
        True,
        "Set moe_layer_recompute=false (MegaMoE already recomputes the dispatched tokens)",
    )
    return found


def decide_mega_moe(config, options: MegaMoEOptions) -> MegaMoEDecision:
    """Whether the model's MoE layers become MegaMoE, and why; raise on settings MegaMoE refuses."""
    if not options.enabled:
        return MegaMoEDecision(
            False,
            "MegaMoE off (enable_primus_turbo and use_turbo_mega_moe not both set): megatron-core MoELayer",
        )
    if not config.num_moe_experts:
        return MegaMoEDecision(
            False, "MegaMoE requested but the model has no MoE layers (num_moe_experts unset)"
        )
    problems = _unsupported(config)
    if problems:
        setting, value, remedy = problems[0]
        others = "" if len(problems) == 1 else f" (also unsupported: {', '.join(p[0] for p in problems[1:])})"
        raise UnsupportedSettingError(setting, value, f"not supported by MegaMoE{others}", remedy)
    on_gpu = torch.cuda.is_available()
    if on_gpu and config.params_dtype != torch.bfloat16:
        raise UnsupportedSettingError(
            "params_dtype", config.params_dtype, "MegaMoE's GPU kernels take bf16 parameters", "Set bf16=true"
        )
    ep = config.expert_model_parallel_size
    precision = options.precision
    triton_kernels = on_gpu and torch.version.hip is None and options.backend in ("auto", "triton")
    if precision in ("mxfp8", "fp8"):
        precision += f" (Triton {precision.upper()} kernels)" if triton_kernels else " (exact emulation)"
    exchange = ""
    if ep > 1 and on_gpu:  # the Triton backends take the EP transport (FP8: NCCL unless set); the rest NCCL
        transport = "nccl"
        if triton_kernels:
            transport = transport_name(
                "triton",
                device=torch.device("cuda"),
                ep_size=ep,
                settings=options.ep,
                precision=options.precision,
            )
        exchange = f", EP exchange={transport}"
    return MegaMoEDecision(
        True,
        f"MoELayer replaced by MegaMoE: enable_primus_turbo and use_turbo_mega_moe on, TP=1, "
        f"{str(config.params_dtype).removeprefix('torch.')} params, EP={ep} "
        f"({config.num_moe_experts // ep} experts/rank){exchange}, backend={options.backend}, precision={precision}",
    )
