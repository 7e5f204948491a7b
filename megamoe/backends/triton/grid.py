"""Integer helpers of the launchers (grids, block sizes), in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from host code each
goes through Triton's constexpr unwrapping, about 2 µs against a few tens of nanoseconds here, and a
small layer's fwd+bwd calls them dozens of times. Kernels keep using ``tl.cdiv``.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
