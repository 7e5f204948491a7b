"""Triton's CPU interpreter for the kernel tests, on machines without CUDA."""

from __future__ import annotations

import os

import torch


def interpret_without_cuda() -> None:
    """Without CUDA: ``TRITON_INTERPRET=1`` (unless set) and the interpreter's compatibility shims
    (``tests/megamoe/triton/interpreter_compat.py``). Triton must see the variable before it is
    imported, so a conftest calls this before any test module imports a kernel."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from tests.megamoe.triton.interpreter_compat import install

        install()
