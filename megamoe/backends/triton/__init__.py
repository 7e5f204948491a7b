"""Triton kernels of the expert path (NVIDIA Hopper first; the same source is meant for AMD).

One kernel per module: ``routing`` (device-side tables), ``grouped_gemm`` (persistent M-grouped GEMM
with gather / SwiGLU prologues and the SwiGLU-backward epilogue), ``wgrad`` (K-grouped weight
gradients), ``combine`` (deterministic weighted top-k reduce), ``padding``; ``ops`` wraps them as
torch custom ops and ``backend`` implements :class:`~megamoe.backends.base.ExpertBackend`.
"""
