"""Blockwise FP8 (DeepSeek-V3's recipe) Triton kernels for Hopper: E4M3 tensor cores, partial sums
promoted to fp32 with their tile scales every 128 of K, quantisation fused into the producers.

The format is :mod:`megamoe.quant.fp8`; the definition of correct is its exact emulation,
:class:`~megamoe.backends.quantized_reference.FP8ReferenceBackend`. docs/fp8.md has the table.
"""
