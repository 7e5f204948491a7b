"""Custom ops for torch.compile that cost nothing in eager mode.

torch.compile needs each Triton step as one opaque ``torch.library`` op: dynamo must not trace a
Triton launch or its TMA descriptors. Called in eager mode, the op's way through the dispatcher, the
custom-op wrapper and its aliasing check costs about a tenth of a millisecond of host time per call,
as much as the kernels of a small layer take on the GPU. :func:`opaque_op` registers the op and
returns a function that calls the op while dynamo traces, and the plain Python function otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def opaque_op(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn`` registered as the custom op ``name`` (no argument mutated), called directly in
    eager mode. The result keeps the op's ``register_fake`` decorator and the op itself as ``.op``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        op = torch.library.custom_op(name, fn, mutates_args=())

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op  # type: ignore[attr-defined]
        call.register_fake = op.register_fake  # type: ignore[attr-defined]
        return call

    return wrap
