"""Make triton 3.6's CPU interpreter work with numpy >= 2.4.

The interpreter keeps scalars as one-element arrays and turns them into Python ints with ``int(a)``
(for ``range`` bounds), which numpy 2.4 turned from a deprecation warning into a TypeError. This
wraps ``__index__`` to take the single element explicitly; nothing else changes.
"""

from __future__ import annotations

import triton.runtime.interpreter as interpreter

_original_patch = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


def install() -> None:
    """Idempotently wrap the interpreter's tensor patching."""
    if interpreter._patch_lang_tensor is not _patch_lang_tensor:
        interpreter._patch_lang_tensor = _patch_lang_tensor
