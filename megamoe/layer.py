"""MegaMoE as ``nn.Module``s: weight modules, the experts, and the whole layer (router + experts + shared).

Legend: T tokens, H hidden, I expert intermediate, E experts, G = E / W local experts, W EP ranks.

``fc1_weight [G, 2I, H]`` and ``fc2_weight [G, H, I]`` live in two :class:`MegaMoEWeightModule`s on
purpose: megatron's DDP hangs its parameter all-gather on *module forward pre-hooks* and its gradient
reduce on per-parameter hooks. Calling ``fc2()`` only when stage 2 starts lets fc2's all-gather overlap
stage 1, and dW2 (computed in stage 2's backward, before stage 1's) starts its reduce while stage 1's
backward still runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megamoe.backends import resolve_backend_name, transport_name
from megamoe.backends.symm.workspace import allocate_workspace
from megamoe.errors import InvalidConfigError
from megamoe.ops import dispatch_grouped_gemm, grouped_gemm_combine
from megamoe.router import MegaMoERouter, RouterConfig
from megamoe.settings import EPSettings


def _ep_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def mark_expert_parallel(param: nn.Parameter) -> nn.Parameter:
    """Tag ``param`` as sharded over EP: megatron DDP reduces it over expert-DP, not DP."""
    param.allreduce = False
    param.expert_parallel = True
    return param


class MegaMoEWeightModule(nn.Module):
    """One parameter whose ``forward()`` returns it: a module boundary for DDP's pre-forward hooks."""

    def __init__(
        self, shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.weight = mark_expert_parallel(nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))

    def forward(self) -> Tensor:
        return self.weight


def init_experts_by_global_id(weight_GXY: Tensor, *, first_expert: int, seed: int, std: float) -> None:
    """Normal init where expert ``e`` draws from its own generator seeded by ``(seed, e)``.

    The weights of a global expert are therefore the same whatever the EP size and rank.
    """
    with torch.no_grad():
        for local in range(weight_GXY.shape[0]):
            gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + first_expert + local)
            values = torch.randn(weight_GXY.shape[1:], generator=gen, dtype=torch.float32) * std
            weight_GXY[local].copy_(values)


class MegaMoEExperts(nn.Module):
    """The G local experts of this EP rank: SwiGLU MLPs run by the fused two-stage op."""

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        ep_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        backend: str = "auto",
        precision: str = "bf16",
        ep_settings: EPSettings | None = None,
    ) -> None:
        super().__init__()
        ep_size, ep_rank = _ep_size_rank(ep_group)
        if num_experts % ep_size:
            raise InvalidConfigError(
                "num_moe_experts",
                num_experts,
                f"not divisible by the EP size {ep_size}",
                "Choose expert_model_parallel_size dividing num_moe_experts",
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        self.ep_group = ep_group
        self.backend = backend
        self.precision = precision
        self.ep_settings = EPSettings.from_env() if ep_settings is None else ep_settings
        """how tokens move at EP > 1: given, or read from the environment once, when the layer is built."""
        G, H, I = self.num_local_experts, hidden_size, ffn_hidden_size
        self.fc1 = MegaMoEWeightModule((G, 2 * I, H), dtype=dtype, device=device)
        self.fc2 = MegaMoEWeightModule((G, H, I), dtype=dtype, device=device)
        self.workspace = None
        """the symmetric-memory workspace this layer's ops use, once :meth:`allocate_workspace` made it."""

    def uses_symmetric_memory(self) -> bool:
        """Whether this layer's tokens move through a symmetric-memory workspace (EP > 1, ``symm``)."""
        ep_size, _ = _ep_size_rank(self.ep_group)
        weight = self.fc1_weight
        concrete = resolve_backend_name(
            self.backend, device=weight.device, dtype=weight.dtype, precision=self.precision
        )
        return (
            transport_name(
                concrete,
                device=weight.device,
                ep_size=ep_size,
                settings=self.ep_settings,
                precision=self.precision,
            )
            == "symm"
        )

    def allocate_workspace(self, *, max_tokens: int, topk: int) -> None:
        """Own the symmetric workspace for ``max_tokens`` tokens per rank (a collective over the EP
        group; layers of one shape share one), instead of the ops allocating it at the first step."""
        weight = self.fc1_weight
        self.workspace = allocate_workspace(
            self.ep_group,
            max_tokens=max_tokens,
            topk=topk,
            num_experts=self.num_experts,
            hidden=weight.shape[2],
            dtype=weight.dtype,
            device=weight.device,
            settings=self.ep_settings.symm,
        )

    @property
    def fc1_weight(self) -> nn.Parameter:
        return self.fc1.weight

    @property
    def fc2_weight(self) -> nn.Parameter:
        return self.fc2.weight

    def reset_parameters(self, seed: int = 0, init_std: float | None = None) -> None:
        """EP-invariant init: std ``1/sqrt(fan_in)`` unless ``init_std`` is given."""
        H, I = self.fc2_weight.shape[1], self.fc2_weight.shape[2]
        init_experts_by_global_id(
            self.fc1_weight, first_expert=self.first_expert, seed=2 * seed, std=init_std or 1 / math.sqrt(H)
        )
        init_experts_by_global_id(
            self.fc2_weight,
            first_expert=self.first_expert,
            seed=2 * seed + 1,
            std=init_std or 1 / math.sqrt(I),
        )

    def forward(self, x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor) -> Tensor:
        h, dispatch_weights, handle = dispatch_grouped_gemm(
            x_TH,
            topk_idx_TK,
            topk_weights_TK,
            self.fc1(),
            self.ep_group,
            backend=self.backend,
            precision=self.precision,
            settings=self.ep_settings,
        )
        return grouped_gemm_combine(h, dispatch_weights, handle, self.fc2(), h_is_private=True)


class SwiGLUMLP(nn.Module):
    """A dense SwiGLU MLP (the shared expert): ``(silu(x Wg^T) * x Wu^T) Wd^T``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False, dtype=dtype)
        self.down = nn.Linear(ffn_hidden_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


@dataclass(kw_only=True, slots=True, frozen=True)
class MegaMoEConfig:
    """A standalone MegaMoE layer (outside megatron-core)."""

    hidden_size: int
    ffn_hidden_size: int
    """I, the intermediate size of each routed expert."""
    router: RouterConfig
    shared_expert_intermediate_size: int | None = None
    backend: str = "auto"
    precision: str = "bf16"
    """number format of the expert GEMMs: ``bf16``, ``mxfp8`` or ``fp8`` (parameters keep ``dtype``)."""
    ep_settings: EPSettings | None = None
    """how tokens move at EP > 1; None: :meth:`EPSettings.from_env` when the layer is built."""
    dtype: torch.dtype = torch.float32
    seed: int = 0


class MegaMoELayer(nn.Module):
    """Router + routed experts (+ optional shared expert). ``forward(x [..., H]) -> (y [..., H], aux_loss)``."""

    def __init__(self, cfg: MegaMoEConfig, *, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = MegaMoERouter(cfg.router, cfg.hidden_size)
        self.experts = MegaMoEExperts(
            num_experts=cfg.router.num_experts,
            hidden_size=cfg.hidden_size,
            ffn_hidden_size=cfg.ffn_hidden_size,
            ep_group=ep_group,
            dtype=cfg.dtype,
            backend=cfg.backend,
            precision=cfg.precision,
            ep_settings=cfg.ep_settings,
        )
        self.experts.reset_parameters(seed=cfg.seed)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SwiGLUMLP(
                cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype=cfg.dtype
            )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        shape = x.shape
        x_TH = x.reshape(-1, shape[-1])
        routing = self.router(x_TH)
        y = self.experts(x_TH, routing.topk_idx, routing.topk_weights)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x_TH)
        return y.view(shape), routing.aux_loss
