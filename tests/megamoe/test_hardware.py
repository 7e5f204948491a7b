"""The MXFP8 speed warning: said for GPUs without block-scaled MMA, once per process, when the MXFP8
kernels are built."""

from __future__ import annotations

import logging

import pytest
import torch

import megamoe.backends
from megamoe.backends import get_backend, hardware
from megamoe.backends.hardware import mxfp8_speed_warning, warn_mxfp8_speed_once


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 9)], ids=["H100/H200", "A100", "L40"])
def test_mxfp8_speed_warning_on_gpus_without_block_scaled_mma(capability):
    message = mxfp8_speed_warning(capability)
    assert message.startswith(
        f"precision='mxfp8' on a GPU of compute capability {capability[0]}.{capability[1]}"
    )
    assert "about 0.35x the bf16 path" in message and "32-deep E4M3 MMA's partial sum" in message
    assert "precision='fp8'" in message and "128 of K" in message


@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (12, 0)], ids=["B200", "B300", "RTX 50"])
def test_mxfp8_speed_warning_silent_with_block_scaled_mma(capability):
    assert mxfp8_speed_warning(capability) is None


@pytest.fixture
def fresh_process(monkeypatch):
    """Nothing warned yet and no backend built yet, as in a new process."""
    monkeypatch.setattr(hardware, "_warned", False)
    monkeypatch.setattr(megamoe.backends, "_CACHE", {})


def test_warn_mxfp8_speed_once_logs_one_warning(fresh_process, caplog):
    with caplog.at_level(logging.WARNING, logger="megamoe.backends.hardware"):
        warn_mxfp8_speed_once((10, 0))
        warn_mxfp8_speed_once((9, 0))
        warn_mxfp8_speed_once((9, 0))
    assert [r.getMessage() for r in caplog.records] == [mxfp8_speed_warning((9, 0))]


def test_building_mxfp8_kernels_for_a_hopper_gpu_warns(fresh_process, caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="megamoe.backends.hardware"):
        get_backend("triton", device=cuda, dtype=torch.bfloat16, precision="mxfp8")
        get_backend("triton", device=cuda, dtype=torch.bfloat16, precision="bf16")
        get_backend("reference", device=cuda, dtype=torch.bfloat16, precision="mxfp8")
    assert len(caplog.records) == 1 and "0.35x" in caplog.records[0].getMessage()
