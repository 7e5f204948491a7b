"""Adapter to Primus-Turbo's FlyDSL MegaMoE kernels (AMD MI355X / gfx950), when ``primus_turbo`` is installed.

Primus-Turbo's ``fused_mega_moe`` and its two stages are autograd ops themselves with our math and our
weight layouts (``w1 [G, 2I, H]``, ``w2 [G, H, I]``), so this backend does not implement the compute
interface of :class:`~megamoe.backends.base.ExpertBackend`: :mod:`megamoe.ops` hands it whole stages
(``native_autograd = True``). What the adapter adds is our argument order (``group`` last), ``y`` cut
back to ``T`` rows (the original returns ``T`` rounded up to 128), and the original's limits checked up
front with a message that says what to use instead, rather than a kernel assert deep in FlyDSL:

* bf16 tensors, an EP group of 2 to 8 ranks (intra-node);
* ``H % 512 == 0`` (1 KiB row copies), ``I % 256 == 0`` (256-wide GEMM tiles, no tail tile);
* ``T % 128 == 0`` and the same ``T`` on every rank (the symmetric heap layout depends on it; checking
  equality across ranks would cost a collective per call, so it is documented, not checked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends.base import StagedBackend
from megamoe.errors import UnsupportedSettingError

_FALLBACK = "use backend='triton' or 'reference' (any shape, any EP size, ragged T)"


@dataclass(frozen=True, slots=True)
class PrimusTurboPlan:
    """What Primus-Turbo's stage 2 needs besides the activations: its handle and the routing."""

    native_handle: Any
    topk_idx: Tensor
    topk_weights: Tensor
    group: dist.ProcessGroup


class PrimusTurboBackend(StagedBackend):
    """Whole-stage delegation to ``primus_turbo.pytorch.ops.moe``."""

    name = "primus_turbo"
    native_autograd = True

    def __init__(self) -> None:
        try:
            from primus_turbo.pytorch.ops import moe
        except ImportError as e:
            raise UnsupportedSettingError(
                "backend",
                "primus_turbo",
                f"primus_turbo is not importable ({e})",
                "Install it (REBUILD_PRIMUS_TURBO=1 primus-cli ..., or pip install 'megamoe[rocm]') or "
                + _FALLBACK,
            ) from e
        self._ops = moe

    def check(
        self, x: Tensor, topk_idx: Tensor, w1: Tensor, w2: Tensor | None, group: dist.ProcessGroup | None
    ) -> None:
        """Raise naming the first limit of the original kernels that these inputs break."""
        ep = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        T, H = x.shape
        I = w1.shape[1] // 2
        limits = [
            (x.dtype == torch.bfloat16, "x.dtype", x.dtype, "must be bfloat16"),
            (2 <= ep <= 8, "expert_model_parallel_size", ep, "must be in [2, 8] (one node)"),
            (H % 512 == 0, "hidden_size", H, "must be a multiple of 512"),
            (I % 256 == 0, "moe_ffn_hidden_size", I, "must be a multiple of 256"),
            (T % 128 == 0, "tokens per rank", T, "must be a multiple of 128 and equal on every rank"),
        ]
        for ok, setting, value, problem in limits:
            if not ok:
                raise UnsupportedSettingError(setting, value, f"Primus-Turbo MegaMoE: {problem}", _FALLBACK)

    def fused(
        self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, group
    ) -> Tensor:
        return self._ops.fused_mega_moe(group, x, topk_idx, topk_weights, w1, w2)[: x.shape[0]]

    def stage1(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, group):
        l1_out, dispatch_weights, native_handle = self._ops.fused_mega_moe_stage1(
            x, topk_idx, topk_weights, w1, group
        )
        return l1_out, dispatch_weights, PrimusTurboPlan(native_handle, topk_idx, topk_weights, group)

    def stage2(
        self, l1_out: Tensor, dispatch_weights: Tensor, plan: PrimusTurboPlan, w2: Tensor, num_tokens: int
    ):
        y = self._ops.fused_mega_moe_stage2(
            l1_out, dispatch_weights, plan.native_handle, plan.topk_idx, plan.topk_weights, w2, plan.group
        )
        return y[:num_tokens]
