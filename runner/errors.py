"""Errors of the launcher: usage mistakes exit 2, launch failures exit 1, both one line, no traceback."""

from __future__ import annotations

from typing import IO, Any

import click


class ConfigError(click.UsageError):
    """A bad launcher config value or command line (exit 2); the message names the setting and the fix."""

    def show(self, file: IO[Any] | None = None) -> None:
        """`Error: <message>` alone: the message already says what to type (no usage block)."""
        click.ClickException.show(self, file)


class LaunchError(click.ClickException):
    """The launch failed before or while running (exit 1): a hook, a missing device, a runtime."""
