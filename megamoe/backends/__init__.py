"""Expert backends behind one interface (:class:`~megamoe.backends.base.ExpertBackend`), and selection.

``auto`` picks the fastest backend that supports the device and dtype: Triton for bf16 on CUDA,
Primus-Turbo's FlyDSL kernels for bf16 on ROCm when ``primus_turbo`` is installed, and the exact
PyTorch reference everywhere else.

``precision`` picks the number format of the expert GEMMs: ``bf16`` (the inputs' own dtype) or
``mxfp8`` (:mod:`megamoe.quant`). MXFP8 has Triton kernels (:mod:`megamoe.backends.triton_mx`), which
``auto`` picks for bf16 on CUDA, and the exact emulation (:mod:`megamoe.backends.mxfp8_reference`),
the choice everywhere else.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from megamoe.backends.base import ExpertBackend
from megamoe.backends.reference import ReferenceBackend
from megamoe.errors import InvalidConfigError, UnsupportedSettingError

BACKEND_NAMES = ("auto", "reference", "triton", "primus_turbo")
PRECISIONS = ("bf16", "mxfp8")


def _require_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        raise UnsupportedSettingError(
            "backend",
            "triton",
            "triton is not installed",
            "pip install 'megamoe[cuda]' or use backend='reference'",
        )


def _load_mxfp8(name: str) -> ExpertBackend:
    if name == "reference":
        from megamoe.backends.mxfp8_reference import MXFP8ReferenceBackend

        return MXFP8ReferenceBackend()
    if name == "triton":
        _require_triton()
        from megamoe.backends.triton_mx.backend import MXFP8TritonBackend

        return MXFP8TritonBackend()
    if name in BACKEND_NAMES:
        raise UnsupportedSettingError(
            "precision",
            "mxfp8",
            f"backend {name!r} has no MXFP8 kernels",
            "Use backend='reference' or 'auto'",
        )
    raise InvalidConfigError("backend", name, "unknown backend", f"Use one of {', '.join(BACKEND_NAMES)}")


def _load(name: str, precision: str) -> ExpertBackend:
    if precision == "mxfp8":
        return _load_mxfp8(name)
    if name == "reference":
        return ReferenceBackend()
    if name == "triton":
        _require_triton()
        from megamoe.backends.triton.backend import TritonBackend

        return TritonBackend()
    if name == "primus_turbo":
        from megamoe.backends.primus_turbo import PrimusTurboBackend

        return PrimusTurboBackend()
    raise InvalidConfigError("backend", name, "unknown backend", f"Use one of {', '.join(BACKEND_NAMES)}")


def resolve_backend_name(
    name: str, *, device: torch.device, dtype: torch.dtype, precision: str = "bf16"
) -> str:
    """Turn ``auto`` into a concrete backend name for tensors on ``device`` of ``dtype``."""
    if name != "auto":
        return name
    if precision == "mxfp8":
        cuda = device.type == "cuda" and dtype == torch.bfloat16 and torch.version.hip is None
        return "triton" if cuda and importlib.util.find_spec("triton") is not None else "reference"
    if device.type == "cuda" and dtype == torch.bfloat16:
        if torch.version.hip is not None:
            return "primus_turbo" if importlib.util.find_spec("primus_turbo") is not None else "reference"
        if importlib.util.find_spec("triton") is not None and importlib.util.find_spec(
            "megamoe.backends.triton.backend"
        ):
            return "triton"
    return "reference"


EP_TRANSPORTS = ("symm", "nccl")


def ep_transport(device: torch.device) -> str:
    """How the Triton backend moves tokens between EP ranks: ``MEGAMOE_EP_TRANSPORT``, else ``symm``
    (fused into the GEMMs over symmetric memory, one node) on CUDA and ``nccl`` (all-to-all) elsewhere."""
    name = os.environ.get("MEGAMOE_EP_TRANSPORT") or ("symm" if device.type == "cuda" else "nccl")
    if name not in EP_TRANSPORTS:
        raise InvalidConfigError(
            "MEGAMOE_EP_TRANSPORT", name, "unknown EP transport", f"Use one of {', '.join(EP_TRANSPORTS)}"
        )
    return name


_CACHE: dict[tuple[str, str], ExpertBackend] = {}


def get_backend(
    name: str = "auto", *, device: torch.device, dtype: torch.dtype, precision: str = "bf16"
) -> ExpertBackend:
    """The backend instance for ``name`` and ``precision`` (``auto`` resolved for ``device``/``dtype``), created once."""
    if precision not in PRECISIONS:
        raise InvalidConfigError(
            "precision", precision, "unknown expert precision", f"Use one of {', '.join(PRECISIONS)}"
        )
    concrete = resolve_backend_name(name, device=device, dtype=dtype, precision=precision)
    key = (concrete, precision)
    if key not in _CACHE:
        _CACHE[key] = _load(concrete, precision)
    return _CACHE[key]


__all__ = [
    "BACKEND_NAMES",
    "EP_TRANSPORTS",
    "PRECISIONS",
    "ExpertBackend",
    "ep_transport",
    "get_backend",
    "resolve_backend_name",
]
