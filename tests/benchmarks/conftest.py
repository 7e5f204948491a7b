"""The benchmark scripts' kernels run in Triton's interpreter on machines without CUDA, with the same
compatibility shims as the kernel tests (tests/megamoe/conftest.py says why)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.megamoe.triton.interpreter_compat import install

    install()
