"""The schema engine behind every configuration of the package.

A config is a frozen dataclass.  Each field is declared once, in the dataclass: its name,
its annotation (the type after parsing), its default, the docstring under it, and, when
the annotation alone does not say how a value is read, a :class:`Spec` in its metadata::

    strategy: ShardingStrategy = field(default=ShardingStrategy.FULL_SHARD, metadata=enum_spec(ShardingStrategy))

From those declarations this module

- reads a mapping (parsed YAML) into a dataclass, section by section (:func:`parse_section`):
  unknown keys are refused with the known ones and a "did you mean", nested sections give
  dotted keys (``optim.lr``), and every problem is collected instead of raised;
- reads a flat dataclass whose fields are written in YAML sections of their own, each field
  naming its place (``Spec.at``, e.g. ``data.seq_len``; :func:`parse_layout`);
- normalises the spellings users write in Python, in ``__post_init__`` (:func:`normalise`);
- checks the value rules declared with :func:`checks` (ranges, non-empty; :func:`check_problems`);
- describes each field for the docs (:func:`field_rows`) with the same texts the errors use.

Fields without a :class:`Spec` are checked against their annotation (``int``, ``float``,
``str``, ``bool``, ``Literal[...]``, ``tuple[...]``, ``dict``, unions and ``None``); a
field whose annotation is a dataclass is a nested section.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import itertools
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.strategy import allowed_values, parse_enum

__all__ = [
    "Check",
    "FieldDoc",
    "Spec",
    "at_least",
    "check_problems",
    "checks",
    "describe",
    "enum_spec",
    "field_names",
    "field_rows",
    "field_spec",
    "finite",
    "hints",
    "key_of",
    "normalise",
    "parse_layout",
    "parse_section",
    "parse_value",
    "spec",
    "unknown_key",
    "yaml_key",
]

Parser = Callable[[Any, str, list[Problem]], Any]
"""``parse(value, dotted_key, problems) -> parsed``: raise ``ValueError`` for a value outside
:attr:`Spec.allowed` (reported with that text), or append detailed problems and return a fallback."""

_META = "fsdp_bridge.schema"
_CHECKS = "fsdp_bridge.checks"
_KEY = "fsdp_bridge.key"


@dataclass(frozen=True)
class Spec:
    """How one field is read and described, where its annotation does not say it all."""

    allowed: str
    """What the field accepts, as a reader would write it: the ``allowed:`` of its errors."""
    parse: Parser | None = None
    """Turns an accepted spelling into the annotated type; None: checked against the annotation."""
    summary: str | None = None
    """A shorter text for the docs' type column (default: :attr:`allowed`)."""
    fix: str = ""
    """The fix named when a value is refused, when that is more than "use an allowed value"."""
    at: str | None = None
    """Where the field lives in a YAML layout of its own (``data.seq_len``): see :func:`parse_layout`."""


@dataclass(frozen=True)
class Check:
    """A rule on a parsed value (a range, non-empty): ``ok(value)`` or a problem with ``allowed``/``fix``.

    Null values of optional fields are not checked.
    """

    ok: Callable[[Any], bool]
    allowed: str
    fix: str = ""


def checks(*rules: Check) -> dict[str, tuple[Check, ...]]:
    """Field metadata declaring value rules: ``field(default=128, metadata=checks(at_least(2)))``."""
    return {_CHECKS: rules}


def yaml_key(name: str) -> dict[str, str]:
    """Field metadata: the field's key in YAML, where it cannot be the attribute's name (a Python
    keyword): ``async_mode: ... = field(default="off", metadata=yaml_key("async"))`` reads and writes
    ``async:``; Python callers use the attribute.  Combine with :func:`checks` by merging the dicts."""
    return {_KEY: name}


def key_of(f: dataclasses.Field[Any]) -> str:
    """The key field ``f`` is written under in YAML, in errors and in the docs (its name unless
    :func:`yaml_key` says otherwise)."""
    return str(f.metadata.get(_KEY, f.name))


def at_least(low: int, *, optional: bool = False) -> Check:
    """An integer >= ``low`` (``optional``: the text says null is allowed too)."""
    return Check(lambda v: v >= low, f"{'null or ' if optional else ''}an integer >= {low}")


def finite(ok: Callable[[float], bool], allowed: str) -> Check:
    """A number for which ``ok`` holds and which is finite (NaN fails every comparison, so write ``ok``
    as a positive test: ``lambda v: v > 0``)."""
    return Check(lambda v: bool(ok(v)) and math.isfinite(v), allowed)


def spec(
    allowed: str,
    parse: Parser | None = None,
    *,
    summary: str | None = None,
    fix: str = "",
    at: str | None = None,
) -> dict[str, Spec]:
    """Field metadata declaring a :class:`Spec`: ``field(default=..., metadata=spec(...))``."""
    return {_META: Spec(allowed, parse, summary, fix, at)}


def enum_spec(enum_cls: type[enum.Enum]) -> dict[str, Spec]:
    """A field holding a member of ``enum_cls``, written as any spelling :func:`parse_enum` accepts."""

    def parse(value: Any, key: str, problems: list[Problem]) -> Any:
        return parse_enum(enum_cls, value)

    values = allowed_values(enum_cls)
    return spec(values, parse, summary=f"one of {values}")


def field_spec(f: dataclasses.Field[Any]) -> Spec | None:
    found = f.metadata.get(_META)
    return found if isinstance(found, Spec) else None


def unknown_key(key: str, value: object, valid: Sequence[str], *, elsewhere: str | None = None) -> Problem:
    """The problem of a key nobody declared: the known keys, and the closest one (or where it lives)."""
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(valid), n=1)
    if elsewhere is not None:
        fix = f"did you mean {elsewhere!r}?"
    else:
        fix = f"did you mean {close[0]!r}?" if close else "remove it"
    return Problem(key, value, f"known keys are {', '.join(valid)}", f"unknown key; {fix}")


# ----------------------------------------------------------------------------------
# Values against annotations
# ----------------------------------------------------------------------------------


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass (cached: configs are built often)."""
    return typing.get_type_hints(cls)


def field_names(cls: type) -> list[str]:
    return [key_of(f) for f in dataclasses.fields(cls)]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def section_type(tp: Any) -> tuple[type | None, bool]:
    """(the section dataclass of a field annotation, whether null is allowed), or (None, False)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp, False
    if _is_union(tp):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1 and isinstance(arms[0], type) and dataclasses.is_dataclass(arms[0]):
            return arms[0], True
    return None, False


def _coerce_scalar(value: Any, tp: Any) -> tuple[bool, Any]:
    if tp is type(None):
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if tp is str:
        return isinstance(value, str), value
    if tp is Any:
        return True, value
    raise TypeError(f"unsupported config field type {tp!r}")


def _coerce_tuple(value: Any, args: tuple[Any, ...]) -> tuple[bool, Any]:
    if isinstance(value, str) and args[-1] is Ellipsis:
        value = [value]  # one item (a file) may be written without a list
    if not isinstance(value, Sequence) or isinstance(value, str):
        return False, None
    arms = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
    if len(arms) != len(value):
        return False, None
    out = []
    for item, arm in zip(value, arms, strict=True):
        ok, parsed = coerce(item, arm)
        if not ok:
            return False, None
        out.append(parsed)
    return True, tuple(out)


def coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(True, ``value`` in the annotated type) or (False, None)."""
    origin = typing.get_origin(tp)
    if _is_union(tp):
        for arm in typing.get_args(tp):
            ok, parsed = coerce(value, arm)
            if ok:
                return True, parsed
        return False, None
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin is tuple:
        return _coerce_tuple(value, typing.get_args(tp))
    if origin is dict:
        return isinstance(value, Mapping), dict(value) if isinstance(value, Mapping) else None
    return _coerce_scalar(value, tp)


_SCALAR_TEXT = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _bare(text: str) -> str:
    return text.removeprefix("a ").removeprefix("an ")


def describe(tp: Any) -> str:
    """A reader's spelling of an annotation, for error messages and the docs."""
    origin = typing.get_origin(tp)
    if _is_union(tp):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if args[-1] is Ellipsis:
            return f"a list of {_bare(describe(args[0]))}s"
        kinds = {_bare(describe(a)) for a in args}
        return f"a list of {len(args)} {kinds.pop()}s" if len(kinds) == 1 else "a list of " + ", ".join(sorted(kinds))
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return _SCALAR_TEXT.get(tp, str(tp))


def allowed_text(f: dataclasses.Field[Any], tp: Any) -> str:
    """What a field accepts: its :class:`Spec`'s text, or its annotation described."""
    found = field_spec(f)
    return found.allowed if found is not None else describe(tp)


# ----------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------

_MISSING: Any = dataclasses.MISSING


def parse_value(f: dataclasses.Field[Any], tp: Any, value: Any, key: str, problems: list[Problem]) -> Any:
    """``value`` read as field ``f`` (annotation ``tp``), or ``MISSING`` with a problem appended."""
    found = field_spec(f)
    if found is not None and found.parse is not None:
        try:
            return found.parse(value, key, problems)
        except ValueError:
            problems.append(Problem(key, value, found.allowed, found.fix))
            return _MISSING
    ok, parsed = coerce(value, tp)
    if ok:
        return parsed
    problems.append(Problem(key, value, allowed_text(f, tp), found.fix if found is not None else ""))
    return _MISSING


def _section_value(
    section: type, value: Any, key: str, problems: list[Problem], elsewhere: Mapping[str, str] | None
) -> Any:
    """A nested section from its mapping (null: all defaults), or ``MISSING`` with problems appended."""
    if value is None:
        value = {}
    from_dict = getattr(section, "from_dict", None)
    if from_dict is not None:  # a section that validates itself (BridgeConfig): its problems, under our key
        try:
            return from_dict(value)
        except ConfigError as err:
            problems.extend(dataclasses.replace(p, key=f"{key}.{p.key}") for p in err.problems)
            return _MISSING
    if not isinstance(value, Mapping):
        problems.append(Problem(key, value, f"a mapping of {', '.join(field_names(section))}"))
        return _MISSING
    return section(**parse_section(section, value, problems, prefix=f"{key}.", elsewhere=elsewhere))


def parse_section(
    cls: type,
    data: Mapping[str, Any],
    problems: list[Problem],
    *,
    prefix: str = "",
    elsewhere: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``cls`` from ``data``: each key checked, every problem appended.

    Keys are named ``prefix + key`` in problems; ``elsewhere`` maps a dotted key people write
    to the key this config keeps it under (named in the unknown-key problem).  Nested sections
    are read recursively; a section class with ``from_dict`` reads itself.
    """
    types_ = hints(cls)
    fields = {key_of(f): f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        f = fields.get(key) if isinstance(key, str) else None
        if f is None:
            problems.append(unknown_key(dotted, value, list(fields), elsewhere=(elsewhere or {}).get(dotted)))
            continue
        section, optional = section_type(types_[f.name]) if field_spec(f) is None else (None, False)
        if section is not None:
            parsed = None if optional and value is None else _section_value(section, value, dotted, problems, elsewhere)
        else:
            parsed = parse_value(f, types_[f.name], value, dotted, problems)
        if parsed is not _MISSING:
            kwargs[f.name] = parsed
    return kwargs


def parse_layout(cls: type, data: Mapping[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """Keyword arguments for a flat dataclass whose fields are written in nested YAML sections.

    Each field lives at its :attr:`Spec.at` path (``data.seq_len``), or under its own name;
    unknown keys and sections that are not mappings are reported at every level, with the
    dotted key; a null section means its defaults.
    """
    types_ = hints(cls)
    tree: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        found = field_spec(f)
        *parents, leaf = ((found.at if found is not None else None) or f.name).split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = f
    kwargs: dict[str, Any] = {}

    def walk(node: dict[str, Any], mapping: Mapping[str, Any], prefix: str) -> None:
        for key, value in mapping.items():
            dotted = f"{prefix}{key}"
            target = node.get(key) if isinstance(key, str) else None
            if target is None:
                problems.append(unknown_key(dotted, value, list(node)))
            elif isinstance(target, dict):
                if isinstance(value, Mapping):
                    walk(target, value, f"{dotted}.")
                elif value is not None:
                    problems.append(Problem(dotted, value, f"a mapping of {', '.join(target)}"))
            else:
                parsed = parse_value(target, types_[target.name], value, dotted, problems)
                if parsed is not _MISSING:
                    kwargs[target.name] = parsed

    walk(tree, data, "")
    return kwargs


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _MISSING


def normalise(obj: Any, problems: list[Problem]) -> None:
    """Parse every field of a frozen dataclass instance in place (its ``__post_init__``).

    Python callers may pass any accepted spelling; afterwards each field holds its annotated
    type.  A value that is not accepted is reported and replaced by the field's default.
    """
    cls: type = type(obj)
    types_ = hints(cls)
    for f in dataclasses.fields(cls):
        parsed = parse_value(f, types_[f.name], getattr(obj, f.name), f.name, problems)
        object.__setattr__(obj, f.name, default_of(f) if parsed is _MISSING else parsed)


def check_problems(obj: Any, prefix: str = "") -> list[Problem]:
    """The problems of the :class:`Check` rules declared on ``obj``'s fields, and of its sections'.

    Sections that validate themselves (with ``from_dict``) are left to their own checks.
    """
    problems: list[Problem] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{key_of(f)}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if not hasattr(value, "from_dict") and field_spec(f) is None:
                problems.extend(check_problems(value, f"{key}."))
            continue
        if value is None:
            continue
        for rule in f.metadata.get(_CHECKS, ()):
            if not rule.ok(value):
                shown = list(value) if isinstance(value, tuple) else value
                problems.append(Problem(key, shown, rule.allowed, rule.fix))
    return problems


# ----------------------------------------------------------------------------------
# The docs: one row per field
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldDoc:
    key: str
    type: str
    default: str
    doc: str


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (read from its source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def default_text(f: dataclasses.Field[Any]) -> str:
    """A field's default as YAML (``required`` when it has none)."""
    value = default_of(f)
    if value is _MISSING:
        return "required"
    if hasattr(value, "to_spelling"):
        value = value.to_spelling()
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, enum.Enum):
        value = value.value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def field_rows(cls: type, prefix: str = "") -> list[FieldDoc]:
    """Every field of ``cls`` and of its nested sections: dotted key, accepted values, default, meaning."""
    rows: list[FieldDoc] = []
    types_ = hints(cls)
    docs = attribute_docs(cls)
    for f in dataclasses.fields(cls):
        key, doc = f"{prefix}{key_of(f)}", docs.get(f.name, "")
        found = field_spec(f)
        section, optional = section_type(types_[f.name]) if found is None else (None, False)
        if section is not None:
            rows.append(FieldDoc(key, "section or null" if optional else "section", "null" if optional else "", doc))
            rows.extend(field_rows(section, f"{key}."))
            continue
        text = describe(types_[f.name]) if found is None else (found.summary or found.allowed)
        rows.append(FieldDoc(key, text, default_text(f), doc))
    return rows
