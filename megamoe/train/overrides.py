"""CLI overrides: ``--key value``, ``--key=value`` and a bare ``--flag`` (meaning true).

Values stay text here; :mod:`megamoe.train.convert` types them by the field they set, which is what
Primus's heuristics got wrong (``null`` and ``1e-4`` stayed strings there). Values may hold ``|``,
``*`` and spaces (pipeline layouts) because they arrive as argv items, never through a shell.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

from megamoe.errors import InvalidConfigError
from megamoe.train import schema
from megamoe.train.convert import annotation_of, unknown_key_error

FLAG = True
"""The value a bare ``--flag`` gets."""


def parse_overrides(tokens: Sequence[str]) -> list[tuple[str, Any]]:
    """argv items -> ``[(key, text or True)]`` in order (a later one wins); keys are checked later."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise InvalidConfigError(
                "override", token, "expected --key value, --key=value or --flag", "Prefix the key with --"
            )
        body = token[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            key, value = body, tokens[i + 1]
            i += 2
        else:
            key, value = body, FLAG
            i += 1
        pairs.append((key.replace("-", "_"), value))
    return pairs


def apply_overrides(
    identity: dict[str, Any], params: dict[str, Any], pairs: list[tuple[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """New (identity, params) with the overrides applied; an unknown key raises with the close match."""
    identity, params = dict(identity), dict(params)
    for key, value in pairs:
        if key in schema.IDENTITY_KEYS:
            identity[key] = value
            continue
        if key not in schema.section_of():
            raise unknown_key_error(key, value, [*schema.section_of(), *schema.IDENTITY_KEYS])
        if value is FLAG and not _accepts_bool(annotation_of(key)):
            raise InvalidConfigError(key, None, "needs a value", f"Write --{key} VALUE")
        params[key] = value
    return identity, params


def _accepts_bool(annotation: Any) -> bool:
    return annotation is bool or bool in typing.get_args(annotation)
