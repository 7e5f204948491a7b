"""A stand-in for the ``grouped_gemm`` package (fanshiqing/grouped_gemm) on ``torch._grouped_mm``.

megatron-core's legacy ``GroupedMLP`` experts import ``grouped_gemm`` and call only
``grouped_gemm.ops.gmm``. That package needs a CUDA build against the exact torch; this one needs
nothing, so the end-to-end benchmark can run megatron's grouped-GEMM experts (its best expert path
without Transformer Engine) on any torch that has ``torch._grouped_mm``. Put this folder (the one
holding ``grouped_gemm/``) first on ``PYTHONPATH``; ``benchmarks.train_e2e_compare`` does.

Not installed with megamoe: a benchmark baseline, not part of the product.
"""

from grouped_gemm import ops

__all__ = ["ops"]
