"""Values to typed settings, by the field's annotation: the one place that decides what ``1e-4`` means.

YAML and the command line both hand us loosely typed values (PyYAML reads ``1e-4`` as a string, the
CLI gives only strings). Converting by annotation makes ``--lr 1e-4`` a float, ``--x null`` None
(for optional fields), ``--flag True`` a bool, and keeps ``--exp_name 123`` a string. Unknown keys
raise with the closest known key.
"""

from __future__ import annotations

import ast
import difflib
import functools
import types
import typing
from typing import Any, Literal, Union

from megamoe.errors import InvalidConfigError
from megamoe.train import schema

_NULLS = frozenset({"null", "none", "~"})
_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def unknown_key_error(key: str, value: Any, known: typing.Iterable[str]) -> InvalidConfigError:
    """``key`` is not a setting; the remedy names the closest one (difflib), if any is close."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    remedy = (
        f"Use {close[0]!r}, the closest known key" if close else "docs/training.md lists the accepted keys"
    )
    return InvalidConfigError(key, value, "unknown setting", remedy)


def build_config(identity: dict[str, Any], params: dict[str, Any]) -> schema.PretrainConfig:
    """Flat experiment params (+ top-level identity keys) -> :class:`PretrainConfig`, strictly."""
    owner = schema.section_of()
    per_section: dict[str, dict[str, Any]] = {name: {} for name in schema.SECTIONS}
    for key, value in params.items():
        if key not in owner:
            raise unknown_key_error(key, value, [*owner, *schema.IDENTITY_KEYS])
        section = owner[key]
        per_section[section][key] = convert(key, value, _hints(schema.SECTIONS[section])[key])
    top = {}
    for key, value in identity.items():
        if key not in schema.IDENTITY_KEYS:
            raise unknown_key_error(key, value, schema.IDENTITY_KEYS)
        top[key] = convert(key, value, str)
    sections = {name: schema.SECTIONS[name](**values) for name, values in per_section.items()}
    return schema.PretrainConfig(**top, **sections)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(schema))


def annotation_of(key: str) -> Any:
    """The type annotation of a flat key (raises for an unknown key)."""
    owner = schema.section_of()
    if key not in owner:
        raise unknown_key_error(key, None, owner)
    return _hints(schema.SECTIONS[owner[key]])[key]


def convert(key: str, value: Any, annotation: Any) -> Any:
    """``value`` as ``annotation`` wants it, or :class:`InvalidConfigError` naming ``key``."""
    if annotation is schema.LayerPattern:
        return _layer_pattern(key, value)
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return _convert_union(key, value, typing.get_args(annotation))
    if value is None or (annotation is not str and _is_null(value)):
        raise InvalidConfigError(key, None, f"null is not allowed, a {_type_name(annotation)} is required")
    if origin is Literal:
        return _convert_literal(key, value, typing.get_args(annotation))
    if origin is list:
        return _convert_list(key, value, typing.get_args(annotation)[0])
    if annotation is bool:
        return _convert_bool(key, value)
    if annotation is int:
        return _convert_int(key, value)
    if annotation is float:
        return _convert_float(key, value)
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise InvalidConfigError(key, value, "expected a string")
        return str(value)
    raise AssertionError(f"no converter for {key}: {annotation!r}")


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in _NULLS)


def _convert_union(key: str, value: Any, args: tuple[Any, ...]) -> Any:
    members = [a for a in args if a is not type(None)]
    if type(None) in args and _is_null(value):
        return None
    for member in members:
        try:
            return convert(key, value, member)
        except InvalidConfigError:
            continue
    allowed = " or ".join(_type_name(m) for m in members) + (" or null" if type(None) in args else "")
    raise InvalidConfigError(key, value, f"expected {allowed}")


def _convert_literal(key: str, value: Any, choices: tuple[Any, ...]) -> Any:
    for choice in choices:
        if value == choice or (isinstance(value, str) and str(choice).lower() == value.strip().lower()):
            return choice
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    remedy = f"Use {close[0]!r}" if close else ""
    raise InvalidConfigError(key, value, f"must be one of {', '.join(map(str, choices))}", remedy)


def _convert_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidConfigError(key, value, "expected a boolean (true/false)")


def _convert_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise InvalidConfigError(key, value, "expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    try:
        number = float(value) if not isinstance(value, str) else _parse_number(value)
    except (TypeError, ValueError):
        raise InvalidConfigError(key, value, "expected an integer") from None
    if float(number) != int(number):
        raise InvalidConfigError(key, value, "expected an integer")
    return int(number)


def _parse_number(text: str) -> int | float:
    text = text.strip().replace("_", "")
    try:
        return int(text)
    except ValueError:
        return float(text)


def _convert_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise InvalidConfigError(key, value, "expected a number, got a boolean")
    try:
        return float(_parse_number(value) if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise InvalidConfigError(key, value, "expected a number such as 1e-4 or 0.5") from None


def _convert_list(key: str, value: Any, item: Any) -> list[Any]:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "(")):
            value = _literal(key, text)
        else:  # "0,3,4" as Primus writes layer-id lists
            value = [part for part in text.split(",") if part.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise InvalidConfigError(key, value, f"expected a list of {_type_name(item)}")
    return [convert(key, v, item) for v in value]


def _literal(key: str, text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise InvalidConfigError(key, text, "not a list literal such as [1, 2]") from None


def _layer_pattern(key: str, value: Any) -> int | list[int]:
    """An int, a 0/1 list, or a list expression of literals, ``*`` and ``+`` such as ``([0]*3+[1]*58)``."""
    if isinstance(value, str):
        text = value.strip()
        try:
            return _convert_int(key, text)
        except InvalidConfigError:
            pass
        try:
            value = _eval_list_expression(ast.parse(text, mode="eval").body)
        except (SyntaxError, ValueError, TypeError) as e:
            raise InvalidConfigError(
                key, text, f"not an int or a list expression ({e})", "Write e.g. 1 or ([0]*3+[1]*58)"
            ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise InvalidConfigError(key, value, "must be >= 1")
        return value
    pattern = _convert_list(key, value, int)
    if any(v not in (0, 1) for v in pattern):
        raise InvalidConfigError(key, value, "a layer pattern holds only 0 (dense) and 1 (MoE)")
    return pattern


def _eval_list_expression(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_list_expression(node.left), _eval_list_expression(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, list):
            raise ValueError("a list can only be multiplied by an int")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"only int/list literals, + and * are allowed, found {type(node).__name__}")


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + "/".join(map(str, typing.get_args(annotation)))
    if typing.get_origin(annotation) is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    return getattr(annotation, "__name__", str(annotation))
