"""The plugin's two user-facing errors, and pydantic's validation errors turned into one
line that names the field and the fix."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from pydantic import ValidationError

from vllm_specexpert.config.sections import fields_of

ADDITIONAL_CONFIG_KEY = "specexpert"
"""The plugin's key in vLLM's ``additional_config``."""


class SpecExpertConfigError(ValueError):
    """A bad ``specexpert`` setting. The message names the field and how to fix it."""

    def __init__(self, field_name: str, problem: str, fix: str) -> None:
        self.field_name, self.problem, self.fix = field_name, problem, fix
        super().__init__(f"specexpert config: field '{field_name}': {problem}. Fix: {fix}")


class SpecExpertUnsupportedError(ValueError):
    """The model or engine setup is one the plugin cannot run (yet)."""

    def __init__(self, what: str, why: str, fix: str) -> None:
        super().__init__(f"specexpert: {what} is not supported: {why}. Fix: {fix}")


def config_error(
    error: ValidationError, cls: type, sections: dict[str, type], index: int = 0
) -> SpecExpertConfigError:
    """The first of pydantic's errors for ``cls`` (whose nested sections are
    ``sections``: key -> class; ``index``: another of them) as one
    :class:`SpecExpertConfigError`."""
    first = error.errors(include_url=False)[index]
    # No list indices, and no union member's tag ("constrained-int", "literal['auto']":
    # not names), which pydantic puts after the field a union's value failed.
    loc = tuple(part for part in first["loc"] if isinstance(part, str) and part.isidentifier())
    field_name = ".".join(loc) or ADDITIONAL_CONFIG_KEY
    owner = sections[loc[-2]] if len(loc) > 1 and loc[-2] in sections else cls
    kind, value = first["type"], first.get("input")
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        known = ", ".join(f.name for f in dataclasses.fields(owner))
        return SpecExpertConfigError(
            field_name, "unknown key", f"remove it; known keys here are {known}"
        )
    if kind == "value_error":
        problem = str(first["ctx"]["error"])
    else:
        problem = f"{first['msg'][0].lower()}{first['msg'][1:]}, got {shown(value)}"
    if kind == "literal_error":
        return SpecExpertConfigError(field_name, problem, "use one of those values")
    if kind in ("dataclass_type", "dict_type", "model_type"):
        return SpecExpertConfigError(
            field_name, problem, "give a JSON object ({} for the defaults)"
        )
    if kind == "bool_type":
        return SpecExpertConfigError(field_name, problem, "give true or false")
    if kind in ("string_type", "string_too_short"):
        return SpecExpertConfigError(
            field_name, problem, "give a path (a non-empty string), or null"
        )
    return SpecExpertConfigError(field_name, problem, fix_from_docs(owner, loc[-1]))


def shown(value: Any) -> str:
    """A rejected value as the user wrote it: ``8.0`` stays ``8.0`` (a float where a count
    is wanted), ``1e300`` is ``1e+300``, not 301 digits."""
    if isinstance(value, float) and math.isfinite(value):
        return (
            repr(value) if abs(value) < 1e16 and value == float(f"{value:.6g}") else f"{value:.6g}"
        )
    return repr(value)


def fix_from_docs(owner: type, name: str) -> str:
    """The field's range from its docstring ("Range: ..."), or its first sentence."""
    info = fields_of(owner).get(name)
    doc = " ".join((info.description or "").split()) if info is not None else ""
    match = re.search(r"Range: (.+?)\.(?:\s|$)", doc)
    if match:
        return f"the range is {match.group(1)}"
    first = re.split(r"(?<=\.)\s", doc)[0]
    return f"'{name}' is {first[0].lower()}{first[1:]}" if first else "see the config docs"
