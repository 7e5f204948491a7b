"""MegaMoE: a fused expert-parallel MoE layer (router, dispatch + grouped GEMM, SwiGLU, combine)."""

__version__ = "0.1.0"
