"""Errors of the launcher: usage mistakes exit 2, launch failures exit 1, both without a traceback."""

from __future__ import annotations

import click


class ConfigError(click.UsageError):
    """A bad launcher config value or command line (exit 2); the message names the setting and the fix."""


class LaunchError(click.ClickException):
    """The launch failed before or while running (exit 1): a hook, a missing device, a runtime."""
