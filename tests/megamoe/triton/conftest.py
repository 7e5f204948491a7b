"""Triton backend tests: CPU logic tests run the kernels under ``TRITON_INTERPRET=1`` in float32;
``gpu``-marked tests need a CUDA GPU (the device machine) and check bf16 numerics and speed paths."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.megamoe.triton.interpreter_compat import install

    install()


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU: run `pytest -m gpu tests/megamoe/triton` on the device machine"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
