"""The keys of a request that no field of its type reads: ignored by the decoder, named back to the sender.

msgspec drops unknown keys, so a typo (`max_token`) or a parameter this service does not
have (`presence_penalty`) would change nothing and say nothing. `unknown_fields` walks the
generic decode of a request beside its type (nested structs, lists of them, tagged unions)
and returns where such keys sit, each with the field it most likely meant.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import inspect as mi

# A hostile record may carry thousands of keys, or keys a megabyte long: the report stays small.
MAX_REPORTED = 8
MAX_KEY_CHARS = 64


@dataclass(frozen=True)
class UnknownField:
    path: str  # e.g. "max_token", "messages[0].nmae"
    suggestion: str | None = None  # the known field of that object it most likely meant

    def describe(self) -> str:
        hint = f" (did you mean `{self.suggestion}`?)" if self.suggestion else ""
        return f"`{self.path}`{hint}"


def unknown_fields(value: Any, request_type: type[msgspec.Struct]) -> list[UnknownField]:
    """The unknown keys of `value` (a request decoded to builtins) against `request_type`, at most
    MAX_REPORTED, in document order."""
    found: list[UnknownField] = []
    _walk(value, _type_info(request_type), "", found)
    return found


@functools.cache
def _type_info(request_type: type[msgspec.Struct]) -> mi.Type:
    return mi.type_info(request_type)  # far slower than the walk itself, and the request types are few


def _clip(key: object) -> str:
    text = key if isinstance(key, str) else repr(key)
    text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= MAX_KEY_CHARS else text[:MAX_KEY_CHARS] + "..."


def _walk(value: Any, info: mi.Type, path: str, found: list[UnknownField]) -> None:
    if len(found) >= MAX_REPORTED:
        return
    if isinstance(info, mi.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        for key, item in value.items():
            if key == info.tag_field:
                continue
            if key in fields:
                _walk(item, fields[key], f"{path}.{key}" if path else key, found)
                continue
            name = _clip(key)
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.75) if isinstance(key, str) else []
            found.append(UnknownField(f"{path}.{name}" if path else name, close[0] if close else None))
            if len(found) >= MAX_REPORTED:
                return
    elif isinstance(info, mi.ListType | mi.VarTupleType) and isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, info.item_type, f"{path}[{i}]", found)
    elif isinstance(info, mi.DictType) and isinstance(value, dict):
        for key, item in value.items():
            _walk(item, info.value_type, f"{path}[{_clip(key)!r}]", found)
    elif isinstance(info, mi.UnionType):
        member = _member(value, info)
        if member is not None:
            _walk(value, member, path, found)


def _member(value: Any, info: mi.UnionType) -> mi.Type | None:
    """The member of a union that `value` decoded as: a struct by its tag (or the union's only struct) for
    an object, the union's list type for an array; None for anything else."""
    if isinstance(value, list):
        return next((t for t in info.types if isinstance(t, mi.ListType | mi.VarTupleType)), None)
    structs = [t for t in info.types if isinstance(t, mi.StructType)]
    if not isinstance(value, dict) or not structs:
        return None
    if len(structs) == 1:
        return structs[0]
    for struct in structs:
        if struct.tag_field is not None and value.get(struct.tag_field) == struct.tag:
            return struct
    return None
