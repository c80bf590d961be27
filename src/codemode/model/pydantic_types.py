"""Pydantic types in tool signatures: the schema, validation and encoding hooks of the one rule.

:class:`~codemode.model.registry.Tool` builds a tool's schemas with msgspec. A parameter or return
annotation that involves pydantic (a ``BaseModel``, or ``Annotated[..., Field(ge=0)]`` and other
pydantic or ``annotated_types`` constraints) is handed to msgspec as an opaque custom type
(:func:`wrap`), whose JSON Schema and validation then come from a pydantic ``TypeAdapter``
through msgspec's hooks. Nothing here imports pydantic unless the program already has: without
pydantic loaded, :func:`involves_pydantic` is always false and the hooks are never reached.
"""

from __future__ import annotations

import sys
import typing
from typing import Any, ClassVar, Final

__all__ = [
    "PydanticValue",
    "dec_hook",
    "enc_hook",
    "involves_pydantic",
    "schema_hook",
    "unwrap",
    "wrap",
]

_CONSTRAINT_MODULES: Final = ("pydantic", "annotated_types")


def _from_constraint_module(value: object) -> bool:
    module = getattr(type(value), "__module__", "") or ""
    return module.split(".", 1)[0] in _CONSTRAINT_MODULES


def involves_pydantic(annotation: object) -> bool:
    """True when ``annotation`` contains a pydantic model or pydantic-style constraint metadata."""
    if "pydantic" not in sys.modules:
        return False
    from pydantic import BaseModel

    seen: set[int] = set()

    def visit(item: object) -> bool:
        if id(item) in seen:
            return False
        seen.add(id(item))
        if isinstance(item, type) and issubclass(item, BaseModel):
            return True
        if typing.get_origin(item) is typing.Annotated and any(
            _from_constraint_module(meta) for meta in typing.get_args(item)[1:]
        ):
            return True
        return any(visit(argument) for argument in typing.get_args(item))

    return visit(annotation)


class PydanticValue:
    """Base of the opaque types :func:`wrap` makes: msgspec defers to their hooks.

    msgspec wants an instance of the type it asked for, so a validated value travels in one;
    :func:`unwrap` takes it out.
    """

    __slots__ = ("value",)

    annotation: ClassVar[Any]
    adapter: ClassVar[Any]  # pydantic.TypeAdapter[Any]
    schema: ClassVar[dict[str, Any]]

    def __init__(self, value: object) -> None:
        self.value = value


def unwrap(value: object) -> object:
    """The validated value in a :class:`PydanticValue`, or ``value`` itself."""
    return value.value if isinstance(value, PydanticValue) else value


def wrap(annotation: object) -> type[PydanticValue]:
    """An opaque stand-in for ``annotation``, validated and described by pydantic.

    Raises ``TypeError`` when pydantic cannot validate or describe ``annotation`` in JSON.
    """
    from pydantic import PydanticUserError, TypeAdapter

    try:
        adapter: TypeAdapter[Any] = TypeAdapter(typing.cast(Any, annotation))
        schema = adapter.json_schema(ref_template="#/$defs/{model}")
    except PydanticUserError as error:
        raise TypeError(str(error).strip().splitlines()[0]) from None
    return type(
        "PydanticValue",
        (PydanticValue,),
        {"__slots__": (), "annotation": annotation, "adapter": adapter, "schema": schema},
    )


def schema_hook(kind: type) -> dict[str, Any]:
    """msgspec's ``schema_hook``: the JSON Schema of a wrapped annotation."""
    if isinstance(kind, type) and issubclass(kind, PydanticValue):
        return dict(kind.schema)
    raise TypeError(f"type {kind!r} is not supported")


def dec_hook(kind: type, value: object) -> object:
    """msgspec's ``dec_hook``: validate ``value`` with pydantic, one compact line per error."""
    if not (isinstance(kind, type) and issubclass(kind, PydanticValue)):
        raise TypeError(f"type {kind!r} is not supported")
    from pydantic import ValidationError

    try:
        return kind(kind.adapter.validate_python(value))
    except ValidationError as error:
        problems = []
        for item in error.errors(include_url=False):
            where = ".".join(str(part) for part in item["loc"])
            problems.append(f"{item['msg']} (at `{where}`)" if where else item["msg"])
        raise ValueError("; ".join(problems)) from None


def enc_hook(value: object) -> object:
    """msgspec's ``enc_hook``: a pydantic model (or a result pydantic can dump) as JSON values."""
    if "pydantic" in sys.modules:
        from pydantic import BaseModel

        if isinstance(value, BaseModel):
            return value.model_dump(mode="json")
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")
