"""A registry of Python tools that serves nested calls from cells (``runtime.md`` §4.4).

Decorate functions with :func:`tool` (or :meth:`ToolRegistry.tool`); the registry publishes them as
:class:`~codemode.protocol.types.ToolDefinition` values for :class:`ExecuteRequest` and, being a
:class:`~codemode.session.CodeModeSessionDelegate`, dispatches the calls cells make.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import inspect
import logging
import time
import typing
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, ParamSpec, TypeVar, overload

import msgspec

from codemode.errors import CodeModeError
from codemode.model import pydantic_types, tracing
from codemode.model.exec_tool import NamespaceDescription
from codemode.model.tracing import CellSpans
from codemode.model.worker_pool import shared_pool
from codemode.protocol.constants import PUBLIC_TOOL_NAME, WAIT_TOOL_NAME
from codemode.protocol.delegation import encode_json
from codemode.protocol.identifiers import normalize_identifier
from codemode.protocol.surrogates import well_formed
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeNestedToolCall,
    CodeModeToolKind,
    ToolDefinition,
    ToolName,
)
from codemode.session import CancellationToken, CodeModeSessionDelegate, current_cell

__all__ = [
    "BeforeCall",
    "Deny",
    "NestedCall",
    "NotifyCallback",
    "Rewrite",
    "Tool",
    "ToolContext",
    "ToolRegistry",
    "current_exec_call_id",
    "flat_tool_name",
    "tool",
]

#: DEBUG: one record per nested call (tool, cell, duration, outcome); ERROR: a tool's traceback.
tools_logger = logging.getLogger("codemode.tools")

P = ParamSpec("P")
R = TypeVar("R")

#: ``(call_id, cell_id, text)``; may be a coroutine function.
NotifyCallback = Callable[[str, CellId, str], Awaitable[None] | None]

_EXEC_ITSELF: Final = "exec cannot invoke itself"
_JSON_TYPES: Final = frozenset({dict, list, str, int, float, bool, type(None)})
_MUTABLE_DEFAULTS: Final = (list, dict, set, bytearray)


def flat_tool_name(tool_name: ToolName) -> str:
    """The definition name of a tool: ``namespace__name``, or ``name`` without namespace."""
    if tool_name.namespace:
        return f"{tool_name.namespace}__{tool_name.name}"
    return tool_name.name


#: The model's ``exec`` call id whose cell the running code serves: set by
#: :class:`~codemode.model.handler.CodeModeToolHandler` (so :class:`~codemode.model.CodeMode`)
#: around ``execute``; a cell's callbacks run in a copy of that context on every carrier. Set it
#: yourself around a ``session.execute`` of your own for :attr:`ToolContext.exec_call_id`.
current_exec_call_id: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "codemode_exec_call_id", default=None
)


class ToolContext:
    """Facts about one nested call, injected into a parameter annotated ``ToolContext``.

    ``call_id`` is the nested call's own outer id (``exec-`` + a UUIDv4, made when first read;
    runtime.md §4.4), not the model's exec call id: that is ``exec_call_id`` (``None`` when the
    cell was not started through :data:`current_exec_call_id`'s setters, e.g. by
    ``session.execute`` directly). ``cell_id`` and ``runtime_tool_call_id`` record that it came
    from code mode.
    """

    __slots__ = ("_call_id", "cancellation", "cell_id", "exec_call_id", "runtime_tool_call_id")

    def __init__(
        self,
        *,
        cell_id: CellId,
        runtime_tool_call_id: str,
        cancellation: CancellationToken,
        call_id: str | None = None,
        exec_call_id: str | None = None,
    ) -> None:
        self.cell_id = cell_id
        self.runtime_tool_call_id = runtime_tool_call_id
        self.cancellation = cancellation
        self._call_id = call_id
        self.exec_call_id = exec_call_id if exec_call_id is not None else current_exec_call_id.get()

    @property
    def call_id(self) -> str:
        """The call's own id (``exec-`` + a UUIDv4)."""
        if self._call_id is None:
            self._call_id = f"exec-{uuid.uuid4()}"
        return self._call_id

    def __repr__(self) -> str:
        return (
            f"ToolContext(call_id={self.call_id!r}, exec_call_id={self.exec_call_id!r}, "
            f"cell_id={self.cell_id!r}, runtime_tool_call_id={self.runtime_tool_call_id!r})"
        )


@dataclass(frozen=True, slots=True)
class NestedCall:
    """A nested call about to run, as the ``before_call`` hook of :class:`ToolRegistry` sees it:
    the tool, the arguments the cell passed (after the input rules) and the call's context."""

    tool: Tool[..., Any]
    arguments: JSON
    context: ToolContext


@dataclass(frozen=True, slots=True)
class Deny:
    """``before_call``'s refusal: the call does not run, the cell's ``await`` rejects with
    exactly ``message``."""

    message: str


@dataclass(frozen=True, slots=True)
class Rewrite:
    """``before_call``'s edit: the call runs with these arguments instead (the same input rules
    apply: an object for a function tool, a string for a freeform one)."""

    arguments: JSON


#: Runs before each nested call: ``None`` lets it run as is; may be a coroutine function (an
#: approval may take long: the call's cancellation still applies, its timeout does not).
BeforeCall = Callable[[NestedCall], Deny | Rewrite | Awaitable[Deny | Rewrite | None] | None]


def _field_type(annotation: object) -> object:
    """The type msgspec is given for an annotation: pydantic-typed ones go through pydantic.

    Raises ``TypeError`` when pydantic cannot handle an annotation that involves it.
    """
    if pydantic_types.involves_pydantic(annotation):
        return pydantic_types.wrap(annotation)
    return annotation


def _schema_of(annotation: object, extra_keys: object = None) -> dict[str, JSON]:
    """A self-contained JSON Schema of a type: the root inlined, other components in ``$defs``.

    ``extra_keys`` (the annotation of a ``**kwargs`` parameter) becomes ``additionalProperties``.
    """
    annotation = _field_type(annotation)
    types = [annotation] if extra_keys is None else [annotation, _field_type(extra_keys)]
    roots, components = msgspec.json.schema_components(
        types, schema_hook=pydantic_types.schema_hook, ref_template="#/$defs/{name}"
    )
    # Schemas pydantic made carry their own `$defs`: hoist them where their refs point.
    hoisted: dict[str, JSON] = {}
    roots = tuple(_hoist_defs(root, hoisted) for root in roots)
    components = {key: _hoist_defs(value, hoisted) for key, value in components.items()}
    for key, value in hoisted.items():
        _add_component(components, key, value)
    schema: dict[str, JSON] = _open_tuples(_inline_root(roots[0], components))
    if extra_keys is not None:
        schema["additionalProperties"] = _open_tuples(roots[1]) or True  # `Any`: the empty schema
    return schema


#: Keywords whose value maps names to schemas (not a schema itself), and keywords whose value
#: is data (a default, a literal), which no schema rule applies to.
_SCHEMA_MAPS: Final = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_DATA_KEYWORDS: Final = frozenset({"const", "enum", "default", "examples"})


def _open_tuples(schema: Any) -> Any:
    """``schema`` without the ``"items": false`` msgspec puts beside a tuple's ``prefixItems``:
    the TypeScript rendering (runtime.md §15.6) reads ``items`` first, and ``false`` made
    ``tuple[int, str]`` an ``Array<never>``; without it, it is ``[number, string]`` (the length
    stays in ``minItems``/``maxItems``, and validation goes by the type hints)."""
    if isinstance(schema, list):
        return [_open_tuples(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            result[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            result[key] = {name: _open_tuples(item) for name, item in value.items()}
        else:
            result[key] = _open_tuples(value)
    if "prefixItems" in result and result.get("items") is False:
        del result["items"]
    return result


def _hoist_defs(schema: Any, into: dict[str, JSON]) -> Any:
    """``schema`` without nested ``$defs`` maps, whose entries are moved to ``into``."""
    if isinstance(schema, list):
        return [_hoist_defs(item, into) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {}
    for key, value in schema.items():
        if key == "$defs" and isinstance(value, dict):
            for name, definition in value.items():
                _add_component(into, name, _hoist_defs(definition, into))
        else:
            result[key] = _hoist_defs(value, into)
    return result


def _add_component(components: dict[str, JSON], name: str, schema: JSON) -> None:
    if components.setdefault(name, schema) != schema:
        raise ValueError(f"two different types are both named `{name}`")


def _no_schema(flat: str, what: str, annotation: object, error: Exception) -> TypeError:
    reason = str(error).strip().splitlines()[-1]  # msgspec's last line names the type
    return TypeError(
        f"tool `{flat}`: {what} {annotation!r} has no JSON Schema ({reason}); "
        "annotate a JSON type (use Any for any value)"
    )


def _result_schema(flat: str, annotation: object) -> JSON:
    """The output schema a return annotation declares (``None`` when it declares nothing)."""
    if annotation is Any or annotation is None or annotation is type(None):
        return None
    try:
        return _schema_of(annotation)
    except (TypeError, ValueError) as error:
        failure = _no_schema(flat, "its return annotation", annotation, error)
        raise TypeError(f"{failure}, or pass output_schema=") from None


def _is_async(call: object) -> bool:
    if inspect.iscoroutinefunction(call):
        return True
    method = getattr(call, "__call__", None)  # noqa: B004 - an object with an async __call__
    return inspect.iscoroutinefunction(method)


def _context_parameter_of(call: Callable[..., Any]) -> str | None:
    """The parameter of ``call`` annotated :class:`ToolContext`, if any."""
    target = call if inspect.isroutine(call) else getattr(call, "__call__", call)  # noqa: B004
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # a builtin, a partial, unresolvable names: no context parameter
        return None
    return next((name for name, hint in hints.items() if hint is ToolContext), None)


def _inline_root(root: dict[str, JSON], components: dict[str, JSON]) -> dict[str, JSON]:
    ref = root.get("$ref")
    if isinstance(ref, str) and len(root) == 1:
        name = ref.removeprefix("#/$defs/")
        referenced = [key for key in components if key != name]
        # Only inline when nothing else points back at the root component (recursive types).
        if not any(_mentions(components[key], ref) for key in referenced) and not _mentions(
            components[name], ref
        ):
            root = dict(components[name])
            root.pop("title", None)
            components = {key: components[key] for key in referenced}
    root = dict(root)
    if components:
        root["$defs"] = components
    return root


def _mentions(schema: JSON, ref: str) -> bool:
    if isinstance(schema, dict):
        return schema.get("$ref") == ref or any(_mentions(v, ref) for v in schema.values())
    if isinstance(schema, list):
        return any(_mentions(item, ref) for item in schema)
    return False


def _default_field(default: object) -> object:
    if isinstance(default, _MUTABLE_DEFAULTS):
        return msgspec.field(default_factory=lambda: copy.deepcopy(default))
    return default


class Tool(Generic[P, R]):
    """A Python function published as a nested tool; calling it calls the function.

    Made by :func:`tool` from type hints, or by :meth:`from_schema` from JSON Schemas.
    """

    __slots__ = (
        "_args_type",
        "_context_parameter",
        "_extra_keys",
        "_positional",
        "_unwrap",
        "_whole_arguments",
        "definition",
        "function",
        "inline",
        "is_async",
    )

    def __init__(
        self,
        function: Callable[P, R],
        *,
        name: str | None = None,
        namespace: str | None = None,
        description: str | None = None,
        output_schema: object = None,
        freeform: bool = False,
        inline: bool = False,
    ) -> None:
        self.function = function
        self.is_async = inspect.iscoroutinefunction(function)
        self.inline = inline
        self._whole_arguments = False
        self._unwrap = False  # whether some parameter is validated by pydantic (wrapped)
        # A functools.partial: hints, name and docstring are its function's, and the keywords
        # it binds are fixed by you, not the model's to pass (they are left out of the schema).
        target: Callable[..., Any] = function
        bound: frozenset[str] = frozenset()
        if isinstance(function, functools.partial):
            target, bound = function.func, frozenset(function.keywords)
        if name is None:
            name = getattr(target, "__name__", None)
            if not isinstance(name, str):
                raise TypeError(f"{function!r} has no __name__: give the tool a name=")
            if not name.isidentifier():  # `<lambda>`: every lambda would be the same tool
                raise TypeError(f"{function!r} has no name of its own: give the tool a name=")
        tool_name = ToolName(name, namespace)
        flat = _checked_flat_name(tool_name)
        try:
            hints = typing.get_type_hints(target, include_extras=True)
        except NameError as error:  # a hint naming a type not visible from the function's module
            raise TypeError(f"tool `{flat}`: cannot resolve its type hints ({error})") from None
        except TypeError:  # not a function: an object with __call__, a builtin
            raise TypeError(
                f"tool `{flat}`: cannot read the type hints of {function!r}: make a tool of a "
                "function (or a functools.partial of one), or use Tool.from_schema"
            ) from None
        fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
        positional: list[str] = []
        self._context_parameter: str | None = None
        # The type of a `**kwargs` parameter, which then receives the undeclared keys.
        self._extra_keys: Any = None
        for parameter in inspect.signature(function).parameters.values():
            if parameter.name in bound and parameter.kind is parameter.KEYWORD_ONLY:
                continue
            annotation = hints.get(parameter.name, Any)
            if parameter.kind is parameter.VAR_POSITIONAL:
                raise TypeError(f"tool `{flat}`: *args parameters are not supported")
            if annotation is ToolContext and parameter.kind is not parameter.VAR_KEYWORD:
                if parameter.kind is parameter.POSITIONAL_ONLY:
                    positional.append(parameter.name)
                self._context_parameter = parameter.name
                continue
            try:
                annotation = _field_type(annotation)
            except TypeError as error:
                raise _no_schema(
                    flat, f"parameter `{parameter.name}`:", annotation, error
                ) from None
            if isinstance(annotation, type) and issubclass(
                annotation, pydantic_types.PydanticValue
            ):
                self._unwrap = True
            if parameter.kind is parameter.VAR_KEYWORD:
                self._extra_keys = dict[str, annotation]  # type: ignore[valid-type]
                continue
            if parameter.kind is parameter.POSITIONAL_ONLY:
                positional.append(parameter.name)
            if parameter.default is parameter.empty:
                fields.append((parameter.name, annotation))
            else:
                fields.append((parameter.name, annotation, _default_field(parameter.default)))
        self._positional = tuple(positional)
        if freeform:
            if self._extra_keys is not None or len(fields) != 1 or fields[0][1] not in (str, Any):
                raise TypeError(f"freeform tool `{flat}` must take exactly one `str` parameter")
            self._args_type: type[msgspec.Struct] | None = None
            input_schema: JSON = None
        else:
            self._args_type = msgspec.defstruct(
                f"{normalize_name(flat)}_arguments",
                fields,
                forbid_unknown_fields=self._extra_keys is None,
            )
            extra = None if self._extra_keys is None else self._extra_keys.__args__[1]
            try:
                input_schema = _schema_of(self._args_type, extra)
            except (TypeError, ValueError) as error:
                raise _parameter_failure(flat, function, fields, error) from None
        if output_schema is None:
            output_schema = _result_schema(flat, hints.get("return", Any))
        elif isinstance(output_schema, Mapping):
            output_schema = _json_schema(flat, "output_schema", output_schema)
        elif not isinstance(output_schema, bool):
            output_schema = _schema_of(output_schema)  # a Python type
        doc = inspect.getdoc(target)
        self.definition = ToolDefinition(
            name=flat,
            tool_name=tool_name,
            description=well_formed((doc or "") if description is None else description),
            kind=CodeModeToolKind.FREEFORM if freeform else CodeModeToolKind.FUNCTION,
            input_schema=input_schema,
            output_schema=output_schema,
        )

    @classmethod
    def from_schema(
        cls,
        name: str,
        description: str,
        input_schema: Mapping[str, JSON] | bool,
        call: Callable[..., Any],
        *,
        output_schema: Mapping[str, JSON] | bool | None = None,
        namespace: str | None = None,
        inline: bool = False,
    ) -> Tool[..., Any]:
        """A tool described by JSON Schemas rather than type hints.

        ``call`` (sync or async) receives the argument object the cell passed, as a ``dict``,
        and returns the JSON result (a pydantic model or msgspec struct is converted); a
        parameter of ``call`` annotated :class:`ToolContext` receives the call's context by
        keyword. The arguments are not validated against ``input_schema``: like every tool,
        the call gets an object (no argument gives ``{}``), anything else is rejected before
        ``call`` runs; checking the properties is ``call``'s business. The schemas are what
        the model is shown (as TypeScript); ``output_schema=None`` declares ``unknown``, and so
        does the boolean schema ``True`` (``False``: ``never``).
        ``inline`` runs a sync ``call`` on the event loop, as for :func:`tool`.
        """
        if not isinstance(input_schema, Mapping | bool):
            raise TypeError(
                f"tool `{name}`: input_schema must be a JSON Schema (an object, or True or False)"
            )
        if output_schema is not None and not isinstance(output_schema, Mapping | bool):
            raise TypeError(
                f"tool `{name}`: output_schema must be a JSON Schema (an object, or True or "
                "False) or None"
            )
        if not callable(call):
            raise TypeError(f"tool `{name}`: call must be callable")
        if not isinstance(description, str):
            raise TypeError(f"tool `{name}`: description must be a string")
        tool_name = ToolName(name, namespace)
        flat = _checked_flat_name(tool_name)
        item: Tool[..., Any] = cls.__new__(cls)
        item.function = call
        item.is_async = _is_async(call)
        item.inline = inline
        item._whole_arguments = True
        item._unwrap = False
        item._args_type = None
        item._extra_keys = None
        item._positional = ()
        item._context_parameter = _context_parameter_of(call)
        item.definition = ToolDefinition(
            name=flat,
            tool_name=tool_name,
            description=well_formed(description),
            kind=CodeModeToolKind.FUNCTION,
            input_schema=_json_schema(flat, "input_schema", input_schema),
            output_schema=(
                None
                if output_schema is None
                else _json_schema(flat, "output_schema", output_schema)
            ),
        )
        return item

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.definition.name!r})"

    def _bind(
        self, arguments: JSON, context: ToolContext | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Validate ``arguments`` against the type hints and split them for the call."""
        name = self.definition.name
        if self._whole_arguments:
            context_only = (
                {} if self._context_parameter is None else {self._context_parameter: context}
            )
            return (arguments,), context_only
        if self._args_type is None:
            values: dict[str, Any] = {self._freeform_parameter(): arguments}
        else:
            hook = pydantic_types.dec_hook
            try:
                # str_keys: a JavaScript object's keys are strings, so a `dict[int, X]`
                # parameter takes {"1": ...} (as JSON decoding would give it).
                converted = msgspec.convert(
                    arguments, self._args_type, dec_hook=hook, str_keys=True
                )
                values = msgspec.structs.asdict(converted)
                unwrap = pydantic_types.unwrap
                if self._unwrap:
                    values = {key: unwrap(value) for key, value in values.items()}
                if self._extra_keys is not None:
                    extra = {k: v for k, v in arguments.items() if k not in values}
                    extra = self._extra_values(extra)
                    values.update({key: unwrap(value) for key, value in extra.items()})
            except msgspec.ValidationError as error:
                raise CodeModeError(f"invalid arguments for tool `{name}`: {error}") from None
        if self._context_parameter is not None:
            values[self._context_parameter] = context
        if not self._positional:
            return (), values
        return tuple([values.pop(parameter) for parameter in self._positional]), values

    def _extra_values(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The undeclared properties, converted for the ``**kwargs`` parameter."""
        hook = pydantic_types.dec_hook
        try:
            converted: dict[str, Any] = msgspec.convert(
                extra, self._extra_keys, dec_hook=hook, str_keys=True
            )
        except msgspec.ValidationError:
            # msgspec puts `$[...]` for a dict's value: find the key, and name it as a declared
            # parameter is named (`- at `$.key``), so the cell learns which one is wrong.
            value_type = self._extra_keys.__args__[1]
            for key, value in extra.items():
                try:
                    msgspec.convert(value, value_type, dec_hook=hook, str_keys=True)
                except msgspec.ValidationError as error:
                    text, found, path = str(error).partition(" - at `$")
                    raise msgspec.ValidationError(
                        f"{text} - at `$.{key}{path if found else '`'}"
                    ) from None
            raise
        return converted

    def _freeform_parameter(self) -> str:
        parameters = inspect.signature(self.function).parameters
        return next(name for name in parameters if name != self._context_parameter)

    async def invoke(self, arguments: JSON, context: ToolContext | None) -> JSON:
        """Validate, run (sync functions in a worker thread, unless ``inline``) and return the
        JSON result. ``context`` goes to a parameter annotated :class:`ToolContext`."""
        args, kwargs = self._bind(arguments, context)
        function: Callable[..., Any] = self.function
        try:
            if self.is_async:
                result = await function(*args, **kwargs)
            elif self.inline:
                result = function(*args, **kwargs)
            else:
                lane = None if context is None else _lane(context.cell_id)
                result = await shared_pool().submit(function, args, kwargs, lane)
            # A sync callable may return a coroutine; JSON values are never awaitable.
            if type(result) not in _JSON_TYPES and inspect.isawaitable(result):
                result = await result
        except CodeModeError:
            raise
        except asyncio.CancelledError as error:
            if _cancel_requested():
                raise
            raise self._failure(error) from error
        except Exception as error:
            raise self._failure(error) from error
        except (SystemExit, KeyboardInterrupt) as error:
            if not self._raised_exit(error):
                raise
            raise self._failure(error) from error
        return self._json(result)

    def _raised_exit(self, error: SystemExit | KeyboardInterrupt) -> bool:
        """Whether the tool itself raised ``error``, which asyncio would let stop the process: a
        ``SystemExit`` always (``sys.exit()`` or argparse inside a tool), a ``KeyboardInterrupt``
        only from a worker thread (Ctrl-C reaches the main thread alone: on the event loop it
        may be the user's, and goes on)."""
        return isinstance(error, SystemExit) or not (self.is_async or self.inline)

    def _failure(self, error: BaseException) -> CodeModeError:
        """What the cell sees of the tool's exception (one line); the traceback is logged."""
        # Whoever runs the agent needs the traceback.
        tools_logger.error("tool `%s` failed", self.definition.name, exc_info=error)
        try:
            text = str(error)
        except Exception:  # a hostile __str__: the cell still gets the tool's failure
            text = "<exception str() failed>"
        return CodeModeError(
            well_formed(f"tool `{self.definition.name}` failed: {type(error).__name__}: {text}")
        )

    def _json(self, result: object) -> JSON:
        """The tool's result as JSON (models and structs converted)."""
        try:
            # str_keys: keys become the strings JSON has (a tuple key is refused here).
            value = msgspec.to_builtins(result, enc_hook=pydantic_types.enc_hook, str_keys=True)
            # to_builtins lets NaN, infinities and lone surrogates through; the encoding that
            # carries the result refuses them, with a text that no longer names the tool.
            encode_json(value)
        except RecursionError:  # a cycle, or nesting deeper than the encoder goes
            reason = "it is nested too deeply (or contains itself)"
        except UnicodeEncodeError as error:
            character = error.object[error.start]
            reason = f"a string holds the lone surrogate U+{ord(character):04X}"
        except (TypeError, ValueError) as error:
            reason = str(error)
        else:
            return typing.cast(JSON, value)
        raise CodeModeError(
            f"tool `{self.definition.name}` returned a value that is not JSON: {reason}"
        )


@overload
def _json_schema(flat: str, what: str, schema: Mapping[str, Any]) -> dict[str, JSON]: ...


@overload
def _json_schema(
    flat: str, what: str, schema: Mapping[str, Any] | bool
) -> dict[str, JSON] | bool: ...


def _json_schema(flat: str, what: str, schema: Mapping[str, Any] | bool) -> dict[str, JSON] | bool:
    """A JSON copy of a schema given as a mapping (what reaches the model and the wire is JSON:
    a key or value JSON has no spelling for would fail every exec description later); a
    boolean schema as it is."""
    if isinstance(schema, bool):
        return schema
    try:
        copied = msgspec.json.decode(msgspec.json.encode(dict(schema)))
    except (TypeError, ValueError, RecursionError) as error:
        reason = "it is nested too deeply" if isinstance(error, RecursionError) else error
        raise TypeError(f"tool `{flat}`: {what} is not JSON ({reason})") from None
    return typing.cast(dict[str, JSON], copied)


def _checked_flat_name(tool_name: ToolName) -> str:
    flat = flat_tool_name(tool_name)
    if well_formed(flat) is not flat:
        raise ValueError(f"tool name {flat!r} has a lone surrogate: it is not text UTF-8 can carry")
    if tool_name.namespace is None and flat in (PUBLIC_TOOL_NAME, WAIT_TOOL_NAME):
        raise ValueError(f"`{flat}` is reserved: exec and wait are never nested tools")
    return flat


def _parameter_failure(
    flat: str,
    function: Callable[..., Any],
    fields: list[tuple[str, Any] | tuple[str, Any, Any]],
    error: Exception,
) -> TypeError:
    """The error naming the first parameter whose annotation has no JSON Schema."""
    target = function.func if isinstance(function, functools.partial) else function
    hints = typing.get_type_hints(target, include_extras=True)
    for field in fields:
        try:
            _schema_of(field[1])
        except (TypeError, ValueError) as failure:
            original = hints.get(field[0], field[1])
            return _no_schema(flat, f"parameter `{field[0]}`:", original, failure)
        if len(field) == 3:  # its default goes into the schema too
            try:
                _schema_of(msgspec.defstruct("default", [field]))
            except (TypeError, ValueError) as failure:
                reason = str(failure).strip().splitlines()[-1]
                return TypeError(
                    f"tool `{flat}`: parameter `{field[0]}`: its default {field[2]!r} is not "
                    f"JSON ({reason}); the model is shown a tool's defaults, so give a JSON "
                    "value (None for none)"
                )
    reason = str(error).strip().splitlines()[-1]
    return TypeError(f"tool `{flat}`: its parameters have no JSON Schema ({reason})")


def normalize_name(name: str) -> str:
    """A Python-identifier-safe spelling of a tool name (for generated type names)."""
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)
    return cleaned if cleaned[:1].isalpha() else f"tool_{cleaned}"


@overload
def tool(function: Callable[P, R], /) -> Tool[P, R]: ...


@overload
def tool(
    *,
    name: str | None = None,
    namespace: str | None = None,
    description: str | None = None,
    output_schema: object = None,
    freeform: bool = False,
    inline: bool = False,
) -> Callable[[Callable[P, R]], Tool[P, R]]: ...


def tool(
    function: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    namespace: str | None = None,
    description: str | None = None,
    output_schema: object = None,
    freeform: bool = False,
    inline: bool = False,
) -> Tool[P, R] | Callable[[Callable[P, R]], Tool[P, R]]:
    """Make a function a nested tool.

    ``name`` defaults to the function name, ``description`` to its docstring; the input schema
    comes from the parameters' type hints (``Annotated[..., msgspec.Meta(description=...)]`` adds
    property descriptions), the output schema from the return annotation. A hint that involves
    pydantic (a model, ``Annotated[int, Field(ge=0)]``) is described and validated by pydantic.
    A hint with no JSON Schema raises ``TypeError`` naming the tool and the parameter.
    ``output_schema`` is a JSON Schema or a Python type. A ``freeform`` tool takes exactly one
    ``str``. For a tool described by JSON Schemas instead, see :meth:`Tool.from_schema`.
    A sync function runs in a worker thread so that it cannot stall the event loop; ``inline``
    runs it on the loop instead (no thread hop: for quick functions that never block).
    """

    def decorate(function: Callable[P, R]) -> Tool[P, R]:
        return Tool(
            function,
            name=name,
            namespace=namespace,
            description=description,
            output_schema=output_schema,
            freeform=freeform,
            inline=inline,
        )

    return decorate if function is None else decorate(function)


class ToolRegistry(CodeModeSessionDelegate):
    """Registered tools, published as definitions and served as the session's delegate.

    Every registered tool is enabled for every cell; a call for anything else is rejected. Sync
    tools run in worker threads (:mod:`codemode.model.worker_pool`: handed over in batches,
    more threads only for calls that wait behind a blocked one); a cancelled call cancels an
    async tool's task (a sync tool's thread cannot be interrupted, so its result is simply
    dropped).

    ``before_call`` runs before every nested call and may let it run, :class:`Deny` it with a
    text the cell sees, or :class:`Rewrite` its arguments. ``timeout`` (seconds) bounds every
    call that has no timeout of its own (:meth:`add`, :meth:`tool`): past it the call's task is
    cancelled and the cell's ``await`` rejects with ``tool `NAME` timed out after N s``.
    """

    def __init__(
        self,
        tools: Iterable[Tool[..., Any]] = (),
        *,
        on_notify: NotifyCallback | None = None,
        before_call: BeforeCall | None = None,
        timeout: float | None = None,
    ) -> None:
        self._tools: dict[ToolName, Tool[..., Any]] = {}
        self._names: set[str] = set()
        # The identifier each tool is on a cell's `tools` object -> that tool's definition name.
        self._identifiers: dict[str, str] = {}
        self._entries: dict[ToolName, _Entry] = {}
        self._namespaces: dict[str, NamespaceDescription] = {}
        self._on_notify = on_notify
        self._before_call = before_call
        self._timeout = _checked_timeout(timeout)
        #: The spans of the cells whose calls this registry serves (``codemode.model.tracing``).
        self.cell_spans = CellSpans()
        for item in tools:
            self.add(item)

    def add(self, item: Tool[P, R], *, timeout: float | None = None) -> Tool[P, R]:
        """Register ``item``; its tool name must be new. ``timeout``: its own bound in seconds
        (else the registry's)."""
        self._register(item, _checked_timeout(timeout) or self._timeout, self._before_call)
        return item

    def include(self, other: ToolRegistry) -> None:
        """Register every tool of ``other`` as ``other`` serves it: with its timeout and under
        ``other``'s ``before_call`` (not this registry's), with ``other``'s namespace
        descriptions (those this one has not set). Its ``on_notify`` is not taken: a
        notification comes from a cell, which this registry serves."""
        for key, entry in other._entries.items():
            self._register(other._tools[key], entry.timeout, entry.before_call)
        for namespace, described in other._namespaces.items():
            self._namespaces.setdefault(namespace, described)

    def _register(
        self, item: Tool[..., Any], timeout: float | None, before_call: BeforeCall | None
    ) -> None:
        key = item.definition.tool_name
        # By its definition name too: namespace `a` + `b__c` must not shadow `a__b` + `c` (one
        # MCP server's tool named to take over the calls meant for another server's).
        if key in self._tools or item.definition.name in self._names:
            raise ValueError(f"tool `{item.definition.name}` is already registered")
        # And by its identifier: `tools.a_b` calls the last of `a-b` and `a_b` (runtime.md §4.1),
        # so one would silently shadow the other.
        identifier = normalize_identifier(item.definition.name)
        if (other := self._identifiers.get(identifier)) is not None:
            raise ValueError(
                f"tool `{item.definition.name}` would be `tools.{identifier}` in a cell, which "
                f"tool `{other}` already is"
            )
        self._names.add(item.definition.name)
        self._identifiers[identifier] = item.definition.name
        self._tools[key] = item
        self._entries[key] = _Entry(item, timeout, before_call)

    @overload
    def tool(self, function: Callable[P, R], /) -> Tool[P, R]: ...

    @overload
    def tool(
        self,
        /,
        *,
        name: str | None = None,
        namespace: str | None = None,
        description: str | None = None,
        output_schema: object = None,
        freeform: bool = False,
        inline: bool = False,
        timeout: float | None = None,
    ) -> Callable[[Callable[P, R]], Tool[P, R]]: ...

    def tool(
        self,
        function: Callable[P, R] | None = None,
        /,
        *,
        name: str | None = None,
        namespace: str | None = None,
        description: str | None = None,
        output_schema: object = None,
        freeform: bool = False,
        inline: bool = False,
        timeout: float | None = None,
    ) -> Tool[P, R] | Callable[[Callable[P, R]], Tool[P, R]]:
        """Like :func:`tool`, and register the result here (``timeout`` as for :meth:`add`)."""

        def decorate(function: Callable[P, R]) -> Tool[P, R]:
            return self.add(
                Tool(
                    function,
                    name=name,
                    namespace=namespace,
                    description=description,
                    output_schema=output_schema,
                    freeform=freeform,
                    inline=inline,
                ),
                timeout=timeout,
            )

        return decorate if function is None else decorate(function)

    def describe_namespace(
        self, namespace: str, description: str, *, title: str | None = None
    ) -> None:
        """Register the text shown above ``namespace``'s tools (heading ``title`` or the name)."""
        self._namespaces[namespace] = NamespaceDescription(title or namespace, description)

    def definitions(self) -> list[ToolDefinition]:
        """The enabled tools, in registration order."""
        return [item.definition for item in self._tools.values()]

    def namespace_descriptions(self) -> Mapping[str, NamespaceDescription]:
        """Registered namespace descriptions, keyed by namespace."""
        return dict(self._namespaces)

    def get(self, tool_name: ToolName) -> Tool[..., Any] | None:
        """The tool registered under ``tool_name``, if any."""
        return self._tools.get(tool_name)

    @staticmethod
    def _arguments(item: Tool[..., Any], invocation: CodeModeNestedToolCall) -> JSON:
        """Apply the §4.4 input rules; the rejection texts are exact."""
        payload = invocation.input
        if item.definition.kind is CodeModeToolKind.FREEFORM:
            if not isinstance(payload, str):
                raise CodeModeError(f"tool `{item.definition.name}` expects a string input")
            return payload
        if type(payload) is dict:
            return payload
        if payload is None:
            return {}
        if not isinstance(payload, dict):
            raise CodeModeError(
                f"tool `{item.definition.name}` expects a JSON object for arguments"
            )
        return payload

    async def invoke_tool(
        self, invocation: CodeModeNestedToolCall, cancellation: CancellationToken
    ) -> JSON:
        """Dispatch one nested call; failures reject the JavaScript promise with their text."""
        entry = self._entries.get(invocation.tool_name)
        if entry is None:
            requested = invocation.tool_name
            if requested.namespace is None and requested.name == PUBLIC_TOOL_NAME:
                raise CodeModeError(_EXEC_ITSELF)
            raise CodeModeError(f"tool `{flat_tool_name(requested)}` is not enabled in exec")
        item = entry.tool
        arguments = self._arguments(item, invocation)
        if not entry.plain or tools_logger.isEnabledFor(logging.DEBUG) or tracing.enabled():
            return await self._full_call(entry, arguments, invocation, cancellation)
        # No hook, no timeout, no record, no span: what `_cancellable` and `Tool.invoke` do, in
        # this one coroutine. Every object a waiting call keeps alive costs garbage-collector
        # time in a burst of a thousand calls: no coroutine per layer, a context only for a
        # tool that takes one.
        context = None
        if item._context_parameter is not None:
            context = ToolContext(
                cell_id=invocation.cell_id,
                runtime_tool_call_id=invocation.runtime_tool_call_id,
                cancellation=cancellation,
            )
        if cancellation.is_cancelled():
            raise CodeModeError(entry.cancelled)
        task = asyncio.current_task()
        if task is None:  # not in a task: _cancellable makes one
            return await _cancellable(
                item.invoke(arguments, context), cancellation, entry.cancelled
            )
        args, kwargs = item._bind(arguments, context)
        function: Callable[..., Any] = item.function
        # The token cancels this task while the call waits; an inline function runs to its end
        # in this step, where there is nothing to cancel.
        guard = None
        try:
            if item.inline and not item.is_async:
                result = function(*args, **kwargs)
            else:
                guard = _TaskCanceller(task)
                cancellation.add_callback(guard)
                if item.is_async:
                    result = await function(*args, **kwargs)
                else:
                    lane = _lane(invocation.cell_id)
                    result = await shared_pool().submit(function, args, kwargs, lane)
            if type(result) not in _JSON_TYPES and inspect.isawaitable(result):
                if guard is None:
                    guard = _TaskCanceller(task)
                    cancellation.add_callback(guard)
                result = await result
        except CodeModeError as error:
            carried = _carried(error)
            if carried is error:
                raise
            raise carried from None
        except asyncio.CancelledError as error:
            if guard is not None and guard.fired and task.cancelling() == 1:  # see _cancellable
                task.uncancel()
                raise CodeModeError(entry.cancelled) from None
            if task.cancelling():
                raise
            raise item._failure(error) from error  # the tool's own (see _cancel_requested)
        except Exception as error:
            raise item._failure(error) from error
        except (SystemExit, KeyboardInterrupt) as error:
            if not item._raised_exit(error):
                raise
            raise item._failure(error) from error
        finally:
            if guard is not None:
                guard.task = None
        return item._json(result)

    async def _full_call(
        self,
        entry: _Entry,
        arguments: JSON,
        invocation: CodeModeNestedToolCall,
        cancellation: CancellationToken,
    ) -> JSON:
        """A call with a hook, a timeout, a DEBUG record or a span."""
        context = ToolContext(
            cell_id=invocation.cell_id,
            runtime_tool_call_id=invocation.runtime_tool_call_id,
            cancellation=cancellation,
        )
        try:
            if tracing.enabled():
                with self.cell_spans.tool_call(invocation.cell_id, entry.tool.definition.name):
                    return await self._logged(entry, arguments, context, invocation)
            return await self._logged(entry, arguments, context, invocation)
        except CodeModeError as error:
            carried = _carried(error)
            if carried is error:
                raise
            raise carried from None

    async def _logged(
        self,
        entry: _Entry,
        arguments: JSON,
        context: ToolContext,
        invocation: CodeModeNestedToolCall,
    ) -> JSON:
        cancellation = context.cancellation
        item = entry.tool
        if not tools_logger.isEnabledFor(logging.DEBUG):
            return await _cancellable(
                self._call(entry, arguments, context), cancellation, entry.cancelled
            )
        began = time.monotonic()
        outcome = "failed"
        try:
            result = await _cancellable(
                self._call(entry, arguments, context), cancellation, entry.cancelled
            )
            outcome = "ok"
            return result
        finally:
            tools_logger.debug(
                "event=tool-call tool=%s cell=%s call=%s seconds=%.6f outcome=%s",
                item.definition.name,
                invocation.cell_id,
                invocation.runtime_tool_call_id,
                time.monotonic() - began,
                "cancelled" if cancellation.is_cancelled() else outcome,
            )

    async def _call(self, entry: _Entry, arguments: JSON, context: ToolContext) -> JSON:
        """The hook, then the tool within its timeout."""
        item = entry.tool
        name = item.definition.name
        if entry.before_call is not None:
            try:
                decision = entry.before_call(NestedCall(item, arguments, context))
                if inspect.isawaitable(decision):
                    decision = await decision
                if isinstance(decision, Rewrite):
                    arguments = self._rewritten(item, decision.arguments)
                elif decision is not None and not isinstance(decision, Deny):
                    raise TypeError(
                        f"before_call returned {decision!r}: expected Deny, Rewrite or None"
                    )
            except Exception as error:
                # The cell gets the delegate's failure text; whoever runs the agent needs the
                # traceback of their hook (nothing was logged: a broken policy went unseen).
                if not isinstance(error, CodeModeError):
                    tools_logger.error("before_call failed for tool `%s`", name, exc_info=error)
                raise
            if isinstance(decision, Deny):
                tools_logger.info("event=tool-call-denied tool=%s cell=%s", name, context.cell_id)
                raise CodeModeError(decision.message)
        timeout = entry.timeout
        if timeout is None:
            return await item.invoke(arguments, context)
        try:
            async with asyncio.timeout(timeout):
                return await item.invoke(arguments, context)
        except TimeoutError:
            # item.invoke turns the tool's own exceptions into CodeModeError: this is ours.
            raise CodeModeError(f"tool `{name}` timed out after {timeout:g} s") from None

    @staticmethod
    def _rewritten(item: Tool[..., Any], arguments: JSON) -> JSON:
        freeform = item.definition.kind is CodeModeToolKind.FREEFORM
        if freeform != isinstance(arguments, str) or not (freeform or isinstance(arguments, dict)):
            shape = "a string" if freeform else "an object"
            raise TypeError(
                f"before_call rewrote `{item.definition.name}`: arguments must be {shape}"
            )
        return arguments

    async def notify(
        self, call_id: str, cell_id: CellId, text: str, cancellation: CancellationToken
    ) -> None:
        """Route a ``notify(...)`` text to the callback given at construction, if any."""
        if self._on_notify is None:
            return
        callback = self._on_notify

        async def deliver() -> None:
            result = callback(call_id, cell_id, text)
            if inspect.isawaitable(result):
                await result

        await _cancellable(deliver(), cancellation, "notification was cancelled")

    def cell_closed(self, cell_id: CellId) -> None:
        """Ends the cell's span if still open; override (calling this) to release your own."""
        self.cell_spans.closed(cell_id)


def _carried(error: CodeModeError) -> CodeModeError:
    """``error``, or one whose text has its lone surrogates as U+FFFD: the text goes to the engine
    as UTF-8 (a file name a tool could not decode, say, used to leave the cell's call unsettled)."""
    message = well_formed(error.message)
    return error if message is error.message else CodeModeError(message)


def _lane(cell_id: CellId) -> object:
    """The worker-pool lane of a cell's sync calls: cells take turns for the threads. Every
    carrier runs a cell's calls in its cell's context, which names it (``current_cell``): the
    cells `1` of two sessions are two lanes, and a cell's calls share one over any carrier."""
    cell = current_cell()
    return id(cell_id) if cell is None else cell


def _cancel_requested() -> bool:
    """Whether a ``CancelledError`` here comes from cancelling the task the call runs in (the
    token, a timeout, whoever runs the session), not from the tool itself: one it raised, or
    got by awaiting something cancelled (another task, a future), is its failure, which names
    it and logs its traceback (it used to reach the cell as "code-mode delegate task was
    cancelled", with nothing logged)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _checked_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"a tool timeout must be a positive number of seconds, not {timeout!r}")
    return timeout


async def _cancellable(
    work: Awaitable[R], cancellation: CancellationToken, cancelled_message: str
) -> R:
    """Await ``work`` in the current task, which the token cancels; a token-cancelled run
    raises the message. (No task of its own: a call that finishes without waiting then settles
    in the step that received it.)"""
    if cancellation.is_cancelled():
        if inspect.iscoroutine(work):
            work.close()  # never started: avoid a "never awaited" warning
        raise CodeModeError(cancelled_message)
    task = asyncio.current_task()
    if task is None:  # not in a task (a caller driving the coroutine by hand): make one
        return await _cancellable(asyncio.ensure_future(work), cancellation, cancelled_message)
    guard = _TaskCanceller(task)
    cancellation.add_callback(guard)
    try:
        return await work
    except asyncio.CancelledError:
        # Ours alone: the token's cancellation becomes the message; anyone else's goes on.
        if guard.fired and task.cancelling() == 1:
            task.uncancel()
            raise CodeModeError(cancelled_message) from None
        raise
    finally:
        guard.task = None


class _TaskCanceller:
    """The token's callback for one call: cancel the task the call runs in, while it does."""

    __slots__ = ("fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task: asyncio.Task[Any] | None = task
        self.fired = False

    def __call__(self) -> None:
        task = self.task
        if task is None:
            return
        loop = task.get_loop()
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        # The token may fire from another thread; a task is only cancelled on its own loop.
        if running is loop:
            self._cancel()
        else:
            loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        if self.task is not None:  # the call may have ended since the token fired
            self.fired = True
            self.task.cancel()


class _Entry:
    """A registered tool with what its calls need: its timeout, its hook (the registry's, or
    that of the registry it was included from), whether it has either (``plain``: neither), and
    its cancelled text, made once."""

    __slots__ = ("before_call", "cancelled", "plain", "timeout", "tool")

    def __init__(
        self, tool: Tool[..., Any], timeout: float | None, before_call: BeforeCall | None
    ) -> None:
        self.tool = tool
        self.timeout = timeout
        self.before_call = before_call
        self.plain = before_call is None and timeout is None
        self.cancelled = f"tool `{tool.definition.name}` was cancelled"
