"""Triton kernels of the expert path (NVIDIA Hopper first; the same source is meant for AMD).

One kernel per module: ``routing`` (device-side tables), ``grouped_gemm`` (persistent M-grouped GEMM,
A by TMA or by row gather), ``wgrad`` (persistent K-grouped weight gradients), ``swiglu`` (forward
and backward passes), ``combine`` (deterministic weighted top-k reduce), ``padding``; ``configs``
holds the tile table, ``ops`` wraps the steps as torch custom ops and ``backend`` implements
:class:`~megamoe.backends.base.ExpertBackend`.
"""
