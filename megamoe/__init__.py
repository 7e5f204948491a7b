"""MegaMoE: a fused expert-parallel MoE layer (router, dispatch + grouped GEMM, SwiGLU, combine).

The public surface is ``__all__`` below; everything else is internal.
"""

from megamoe.backends.symm.workspace import SymmWorkspace, allocate_workspace, check_capacity
from megamoe.errors import InvalidConfigError, MegaMoEError, UnsupportedSettingError
from megamoe.ops import MegaMoEHandle, dispatch_grouped_gemm, fused_mega_moe, grouped_gemm_combine
from megamoe.quant import advance_weight_generation
from megamoe.router import AuxLossScaler, MegaMoERouter, RouterConfig, RouterOutput, topk_routing
from megamoe.settings import EPSettings, SymmSettings

__version__ = "0.1.0"

__all__ = [
    "AuxLossScaler",
    "EPSettings",
    "InvalidConfigError",
    "MegaMoEError",
    "MegaMoEHandle",
    "MegaMoERouter",
    "RouterConfig",
    "RouterOutput",
    "SymmSettings",
    "SymmWorkspace",
    "UnsupportedSettingError",
    "advance_weight_generation",
    "allocate_workspace",
    "check_capacity",
    "dispatch_grouped_gemm",
    "fused_mega_moe",
    "grouped_gemm_combine",
    "topk_routing",
]
