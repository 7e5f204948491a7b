"""Errors raised by megamoe: each names the setting, its value, the problem and the remedy.

Messages read ``<setting>=<value>: <problem>. <remedy>.`` so a user can fix the config without
reading our code.
"""

from __future__ import annotations

from typing import Any


class MegaMoEError(Exception):
    """Base class of every error megamoe raises on purpose."""

    def __init__(self, setting: str, value: Any, problem: str, remedy: str = "") -> None:
        self.setting = setting
        self.value = value
        self.problem = problem
        self.remedy = remedy
        message = f"{setting}={value!r}: {problem}."
        if remedy:
            message += f" {remedy.rstrip('.')}."
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by fields (the default re-calls ``__init__`` with the message alone): errors travel
        between ranks and processes."""
        return (type(self), (self.setting, self.value, self.problem, self.remedy))


class InvalidConfigError(MegaMoEError, ValueError):
    """A value that is wrong (bad shape, out of range, inconsistent with another value)."""


class UnsupportedSettingError(MegaMoEError, NotImplementedError):
    """A valid setting that MegaMoE does not implement; the remedy says what to use instead."""


def shape_error(name: str, tensor_shape: Any, expected: str, remedy: str = "") -> InvalidConfigError:
    """Error for a tensor whose shape does not match the contract (`expected` names the dims)."""
    return InvalidConfigError(f"{name}.shape", tuple(tensor_shape), f"expected {expected}", remedy)
