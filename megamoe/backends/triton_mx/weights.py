"""The expert weights' two MX forms for the MXFP8 kernels, through the shared :class:`WeightCache`.

``w [G, Y, X]`` is used rowwise (blocks along X: the forward's B operand ``[G, N=Y, K=X]``) and
transposed (``w^T [G, X, Y]`` contiguous, blocks along Y: the dgrad's B operand). The cache keys,
stamps and in-place refresh are :mod:`megamoe.quant.cache`'s; this module only supplies

* the quantiser: the Triton kernels instead of PyTorch ops (one pass over the weight per form instead
  of a dozen, which matters because every use re-quantises until the trainer advances the generation,
  and always during CUDA graph capture);
* the scale layout: codes stored block-major (``[B, G, Y]`` storage behind the ``[G, Y, B]`` view),
  so a GEMM tile reads the codes of its BLOCK_N columns for one K block as one contiguous line.

The values are bit-identical to ``quantize_mx(w, dim=-1)`` and ``quantize_mx(w.transpose(1, 2), dim=-1)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megamoe.backends.triton_mx.quantize_rows import quantize_rows
from megamoe.backends.triton_mx.quantize_segments import quantize_transposed_weight
from megamoe.quant.cache import WeightCache
from megamoe.quant.mx import BLOCK, MXTensor


def empty_weight_mx(shape: tuple[int, ...], device: torch.device) -> MXTensor:
    """Uninitialised MX buffers for a ``[G, N, K]`` form blocked along K, codes stored block-major."""
    G, N, K = shape
    blocks = -(-K // BLOCK)
    return MXTensor(
        data=torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
        scale=torch.empty(blocks, G, N, dtype=torch.uint8, device=device).permute(1, 2, 0),
        dim=2,
    )


def quantize_weight(source: Tensor, out: MXTensor) -> None:
    """Fill ``out`` with ``source`` (``w`` or ``w.transpose(1, 2)``) blocked along its last dim."""
    G, N, K = source.shape
    if source.transpose(1, 2).is_contiguous() and not source.is_contiguous():
        quantize_transposed_weight(source.transpose(1, 2), out)
        return
    rows = MXTensor(data=out.data.view(G * N, K), scale=out.scale.view(G * N, out.scale.shape[2]), dim=1)
    quantize_rows(source.contiguous().view(G * N, K), rows)


def weight_cache() -> WeightCache:
    """A :class:`WeightCache` that quantises with the Triton kernels into the kernels' scale layout."""
    return WeightCache(quantize=quantize_weight, empty=empty_weight_mx)
