"""Expert backends behind one interface (:class:`~megamoe.backends.base.ExpertBackend`), and selection.

``auto`` picks the fastest backend that supports the device and dtype: Triton for bf16 on CUDA,
Primus-Turbo's FlyDSL kernels for bf16 on ROCm when ``primus_turbo`` is installed, and the exact
PyTorch reference everywhere else.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from megamoe.backends.base import ExpertBackend
from megamoe.backends.reference import ReferenceBackend
from megamoe.errors import InvalidConfigError, UnsupportedSettingError

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "reference", "triton", "primus_turbo")


def _load(name: str) -> ExpertBackend:
    if name == "reference":
        return ReferenceBackend()
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise UnsupportedSettingError(
                "backend", name, "triton is not installed", "pip install 'megamoe[cuda]' or use backend='reference'"
            )
        from megamoe.backends.triton.backend import TritonBackend

        return TritonBackend()
    if name == "primus_turbo":
        from megamoe.backends.primus_turbo import PrimusTurboBackend

        return PrimusTurboBackend()
    raise InvalidConfigError("backend", name, "unknown backend", f"Use one of {', '.join(BACKEND_NAMES)}")


def resolve_backend_name(name: str, *, device: torch.device, dtype: torch.dtype) -> str:
    """Turn ``auto`` into a concrete backend name for tensors on ``device`` of ``dtype``."""
    if name != "auto":
        return name
    if device.type == "cuda" and dtype == torch.bfloat16:
        if torch.version.hip is not None:
            return "primus_turbo" if importlib.util.find_spec("primus_turbo") is not None else "reference"
        if importlib.util.find_spec("triton") is not None and importlib.util.find_spec(
            "megamoe.backends.triton.backend"
        ):
            return "triton"
    return "reference"


_CACHE: dict[str, ExpertBackend] = {}


def get_backend(name: str = "auto", *, device: torch.device, dtype: torch.dtype) -> ExpertBackend:
    """The backend instance for ``name`` (``auto`` resolved for ``device``/``dtype``), created once."""
    concrete = resolve_backend_name(name, device=device, dtype=dtype)
    if concrete not in _CACHE:
        _CACHE[concrete] = _load(concrete)
    return _CACHE[concrete]


__all__ = ["BACKEND_NAMES", "ExpertBackend", "get_backend", "resolve_backend_name"]
