"""SonicMoE (Dao-AILab's CuTe-DSL/QuACK expert kernels) behind our layer's signature, for the bench.

Shape letters as in DESIGN.md: T tokens, H hidden, I expert intermediate, G local experts, K top-k,
R = T*K routed rows. SonicMoE's general-routing entry takes the routing as R (token, expert, weight)
triples sorted by token and its weights expert-last (``w1 [2I, H, G]``, ``w2 [H, I, G]``); our
``w1 [G, 2I, H]`` and ``w2 [G, H, I]`` permuted give exactly those strides without a copy, and its
``concat_layout`` reads the gate rows first and the up rows second, as our SwiGLU does. Its six QuACK
GEMMs (two forward, four backward) autotune on the first call of each shape, compiling and timing
every candidate tile config (minutes per shape; ``QUACK_CACHE_AUTOTUNING=1`` keeps the choices on
disk, benchmarks/run_sonic_compare.sh carries them between machines), so a caller warms every shape
before timing. SonicMoE is not a dependency of megamoe: the bench imports it only when asked to
compare.
"""

from __future__ import annotations

import torch
from torch import Tensor

IMPORT_ERRORS = (ImportError, OSError, RuntimeError)
"""What importing SonicMoE raises where it cannot run: missing, or its CuTe DSL's native libraries or
CUDA driver not found when the package loads."""


def import_error() -> str | None:
    """Why ``sonicmoe`` cannot be imported here, or None when it can (the package imports its kernels)."""
    try:
        import sonicmoe  # noqa: F401
    except IMPORT_ERRORS as e:
        return f"{type(e).__name__}: {e}"
    return None


def sonic_layer(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, w2_GHI: Tensor
) -> Tensor:
    """``y [T, H]`` of :func:`megamoe.fused_mega_moe` computed by SonicMoE, differentiable in ``x``,
    ``topk_weights``, ``w1`` and ``w2``. Every slot must name an expert (SonicMoE has no dropped
    ``-1`` slot). The forward keeps what SonicMoE's backward needs also under ``torch.no_grad``, as a
    training forward does, like the other implementations the bench times."""
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_general_routing_inputs

    T, K = topk_idx_TK.shape
    token_R = torch.arange(T, device=x_TH.device, dtype=torch.int32).repeat_interleave(K)
    y_TH, _ = moe_general_routing_inputs(
        x_TH,
        topk_weights_TK.reshape(-1),
        token_R,
        topk_idx_TK.reshape(-1).int(),
        w1_G2IH.permute(1, 2, 0),
        None,
        w2_GHI.permute(1, 2, 0),
        None,
        w1_G2IH.shape[0],
        torch.cuda.current_stream(x_TH.device).cuda_stream,
        ActivationType.SWIGLU,
        False,
        concat_layout=True,
    )
    return y_TH
