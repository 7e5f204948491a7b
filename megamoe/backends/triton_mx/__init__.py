"""MXFP8 Triton kernels of the expert path on one GPU (Hopper: E4M3 MMA with per-32 scaled partial sums).

One kernel per module: ``quantize_rows`` (MX blocks along each row), ``quantize_segments`` (MX blocks
along R inside each expert's rows, written transposed for the wgrad and the transposed weight form),
``grouped_gemm`` (persistent M-grouped MX GEMM, A by TMA or by row gather), ``wgrad`` (K-grouped MX
weight gradients), ``swiglu`` (SwiGLU forward emitting ``q(a)``; backward emitting ``dh``,
``<da, a>`` and ``q(w a)`` along R); ``mx_math`` holds the format's bit arithmetic, ``configs`` the
tiles, ``weights`` the weight cache's quantiser and ``backend`` the
:class:`~megamoe.backends.base.ExpertBackend`. The definition of correct is
:mod:`megamoe.backends.quantized_reference`; docs/mxfp8.md describes the design.
"""
