"""Addressing another GPU's copy of a symmetric buffer from inside a kernel.

A symmetric buffer has the same layout on every rank; a table of every rank's base address
(``bases``, int64 each) turns a pointer into this rank's buffer into the same element in rank ``r``'s.
The grouped GEMMs' remote epilogues and the fused EP kernels (:mod:`megamoe.backends.symm`) use it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def peer_ptr(local_ptr, bases, rank, r):
    """``local_ptr`` moved into rank ``r``'s copy of the workspace.

    Buffer bases are page-aligned, so the shift is a multiple of 16 elements; saying so keeps the
    compiler's 16-byte vector loads and stores (an address cast from an integer would get 2-byte ones).
    """
    elem = local_ptr.dtype.element_ty.primitive_bitwidth // 8
    delta = (tl.load(bases + r) - tl.load(bases + rank)) // elem
    return local_ptr + tl.multiple_of(delta, 16)
