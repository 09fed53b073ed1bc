"""A small JSON Schema validator for the subset ``task.schema.json`` uses.

Why hand-written: the project does not depend on ``jsonschema``, and a task file must be
checked the same way everywhere (CLI, preflight, trainer). Interpreting the published
schema file (instead of duplicating its rules in code) keeps the two from drifting.
Every error carries its JSON path (``$.conditions.memory``), and all errors are
collected, not just the first.

Supported keywords: type, enum, const, properties, required, additionalProperties
(boolean), patternProperties, items, minItems, minLength, maxLength, pattern, minimum,
maximum, exclusiveMinimum, anyOf. Anything else in the schema is ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Issue:
    """One validation error: where (a JSON path) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@cache
def task_schema() -> dict[str, Any]:
    """The published schema (``broker/grading/task.schema.json``)."""
    text = resources.files("broker.grading").joinpath("task.schema.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[name])


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"{path}[{key!r}]"


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> list[Issue]:
    """All the ways ``value`` breaks ``schema`` (empty when it conforms)."""
    issues: list[Issue] = []
    if "anyOf" in schema:
        branches = [validate(value, s, path) for s in schema["anyOf"]]
        if all(branches):
            kinds = " or ".join(_describe(s) for s in schema["anyOf"])
            typed = [b for b in branches if not b[0].message.startswith("expected ")]
            best = min(typed or branches, key=len)
            detail = f" ({best[0].message})" if len(best) == 1 else ""
            issues.append(Issue(path, f"expected {kinds}{detail}"))
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, n) for n in names):
            got = type(value).__name__
            return [*issues, Issue(path, f"expected {' or '.join(names)}, got {got}")]
    if "enum" in schema and value not in schema["enum"]:
        issues.append(Issue(path, f"must be one of {schema['enum']}, got {value!r}"))
    if "const" in schema and value != schema["const"]:
        issues.append(Issue(path, f"must be {schema['const']!r}"))
    if isinstance(value, str):
        issues += _string(value, schema, path)
    if _is_type(value, "number"):
        issues += _number(value, schema, path)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            issues.append(Issue(path, f"needs at least {schema['minItems']} item(s)"))
        if "items" in schema:
            for i, item in enumerate(value):
                issues += validate(item, schema["items"], _child(path, i))
    if isinstance(value, dict):
        issues += _object(value, schema, path)
    return issues


def _describe(schema: dict[str, Any]) -> str:
    kind = schema.get("type", "value")
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def _string(value: str, schema: dict[str, Any], path: str) -> list[Issue]:
    issues = []
    if len(value) < schema.get("minLength", 0):
        issues.append(Issue(path, "must not be empty" if not value else "is too short"))
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        issues.append(Issue(path, f"is longer than {schema['maxLength']} characters"))
    if "pattern" in schema and not re.search(schema["pattern"], value):
        issues.append(Issue(path, f"{value[:80]!r} does not match {schema['pattern']}"))
    return issues


def _number(value: float, schema: dict[str, Any], path: str) -> list[Issue]:
    issues = []
    if "minimum" in schema and value < schema["minimum"]:
        issues.append(Issue(path, f"must be >= {schema['minimum']}, got {value}"))
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        issues.append(Issue(path, f"must be > {schema['exclusiveMinimum']}, got {value}"))
    if "maximum" in schema and value > schema["maximum"]:
        issues.append(Issue(path, f"must be <= {schema['maximum']}, got {value}"))
    return issues


def _object(value: dict[str, Any], schema: dict[str, Any], path: str) -> list[Issue]:
    issues = []
    props: dict[str, Any] = schema.get("properties", {})
    patterns: dict[str, Any] = schema.get("patternProperties", {})
    for name in schema.get("required", []):
        if name not in value:
            issues.append(Issue(_child(path, name), "is required"))
    for key, item in value.items():
        if not isinstance(key, str):
            issues.append(Issue(path, f"key {key!r} is not a string"))
            continue
        if key in props:
            issues += validate(item, props[key], _child(path, key))
            continue
        matched = [s for p, s in patterns.items() if re.search(p, key)]
        for sub in matched:
            issues += validate(item, sub, _child(path, key))
        if not matched and schema.get("additionalProperties", True) is False:
            hint = _close_match(key, list(props))
            issues.append(Issue(_child(path, key), f"unknown field{hint}"))
    return issues


def _close_match(key: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
