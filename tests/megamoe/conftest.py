"""Tests of the Triton kernels (triton/, symm/) run on any machine.

CPU logic tests run the kernels under ``TRITON_INTERPRET=1`` in float32. Triton reads that variable
when a kernel is decorated, so it is set here, before any test module imports the kernels, and only
on machines without CUDA. ``gpu``-marked tests need a CUDA GPU (the device machine: ``pytest -m gpu
tests/megamoe``) and ``multigpu`` ones two; elsewhere they are deselected, not skipped, and the
summary says so.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests._interpret import interpret_without_cuda

HAS_CUDA = torch.cuda.is_available()
NUM_GPUS = torch.cuda.device_count() if HAS_CUDA else 0
HERE = Path(__file__).parent  # tests/megamoe: triton/ and symm/

interpret_without_cuda()

_deselected: list[str] = []


def _needs_more_gpus(item) -> bool:
    if "multigpu" in item.keywords:
        return NUM_GPUS < 2
    return "gpu" in item.keywords and not HAS_CUDA


def pytest_collection_modifyitems(config, items) -> None:
    keep, drop = [], []
    for item in items:
        mine = HERE in Path(str(item.path)).parents
        (drop if mine and _needs_more_gpus(item) else keep).append(item)
    if drop:
        _deselected.extend(item.nodeid for item in drop)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter) -> None:
    if _deselected:
        terminalreporter.write_line(
            f"megamoe: {len(_deselected)} gpu tests deselected ({NUM_GPUS} CUDA GPUs here); "
            "run `pytest -m gpu tests/megamoe` on a GPU machine (multigpu ones need 2 GPUs)"
        )
