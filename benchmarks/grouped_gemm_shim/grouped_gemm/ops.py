"""``gmm``: the one call megatron-core's ``GroupedMLP`` makes, on ``torch._grouped_mm``."""

from __future__ import annotations

import torch


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """Rows ``a[M, K]`` in expert order times ``b[E, K, N]`` (``b[E, N, K]`` with ``trans_b``): expert
    ``e`` multiplies the next ``batch_sizes[e]`` rows. Differentiable in ``a`` and ``b``.

    ``batch_sizes`` may live on the host (as the original package requires) or on the device; the
    cumulative row offsets ``torch._grouped_mm`` takes are int32 on ``a``'s device.
    """
    if a.dim() != 2 or b.dim() != 3 or batch_sizes.dim() != 1 or batch_sizes.numel() != b.shape[0]:
        raise ValueError(
            f"gmm: expected a[M, K], b[E, K, N] and batch_sizes[E]; got {tuple(a.shape)}, "
            f"{tuple(b.shape)}, {tuple(batch_sizes.shape)}"
        )
    offs = torch.cumsum(batch_sizes.to(device=a.device, non_blocking=True), 0, dtype=torch.int32)
    out = torch._grouped_mm(a, b.transpose(-2, -1) if trans_b else b, offs=offs)
    if out.requires_grad:
        # torch._grouped_mm's backward refuses a gradient with zero strides (an expanded one, as a
        # sum's gradient is); megatron never hands it one, a test may.
        out.register_hook(torch.Tensor.contiguous)
    return out
