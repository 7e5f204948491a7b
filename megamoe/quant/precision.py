"""Validation of an expert-precision setting, for configs that expose it under their own name."""

from __future__ import annotations

from megamoe.backends import PRECISIONS
from megamoe.errors import InvalidConfigError


def check_precision(value: object, *, setting: str = "precision") -> str:
    """Return ``value`` if it names an expert precision, else raise naming ``setting`` and the choices.

    The trainer passes ``setting="turbo_mega_moe_precision"`` so the message names the key users type.
    """
    if value not in PRECISIONS:
        raise InvalidConfigError(
            setting, value, "unknown expert precision", f"Set {setting} to one of {', '.join(PRECISIONS)}"
        )
    return str(value)
