"""Make triton 3.6's CPU interpreter work with numpy >= 2.4, and give it a bf16 ``tl.dot``.

* The interpreter keeps scalars as one-element arrays and turns them into Python ints with ``int(a)``
  (for ``range`` bounds), which numpy 2.4 turned from a deprecation warning into a TypeError. This
  wraps ``__index__`` to take the single element explicitly.
* The interpreter stores bf16 as uint16 and its ``tl.dot`` multiplies those bit patterns. This widens
  bf16 dot operands to fp32 first (exact), so bf16 GEMM kernels compute products under the
  interpreter; its fp32 -> bf16 casts still truncate where the GPU rounds to nearest, so bf16 bits
  differ from the GPU's (compare bf16 results to a tolerance, or interpreted paths to each other).
"""

from __future__ import annotations

import numpy as np
import triton.language as tl
import triton.runtime.interpreter as interpreter

_original_patch = interpreter._patch_lang_tensor
_original_dot = interpreter.InterpreterBuilder.create_dot


def _patch_lang_tensor(tensor, scope) -> None:
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


def _as_fp32(handle):
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
    return interpreter.TensorHandle(data.reshape(handle.data.shape), tl.float32)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _original_dot(self, _as_fp32(a), _as_fp32(b), d, input_precision, max_num_imprecise_acc)


def install() -> None:
    """Idempotently wrap the interpreter's tensor patching and its ``tl.dot``."""
    if interpreter._patch_lang_tensor is not _patch_lang_tensor:
        interpreter._patch_lang_tensor = _patch_lang_tensor
    if interpreter.InterpreterBuilder.create_dot is not _create_dot:
        interpreter.InterpreterBuilder.create_dot = _create_dot
