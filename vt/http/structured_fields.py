"""The structured-output fields of a request body -> one GrammarSpec and the field that asked.

Three spellings ask for the same thing: OpenAI's `response_format` (`json_object`, or
`json_schema` with `schema` and `strict`), vLLM's `structured_outputs` object (exactly one of
`json`, `regex`, `choice`, `grammar`, `json_object`, with `disable_any_whitespace`,
`disable_additional_properties` and `whitespace_pattern`), and vLLM's older top-level
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with
`guided_whitespace_pattern`). A request may use one of them; two constraints are a 400 naming
the second. Whether the grammar compiles is checked later, off the event loop
(GrammarCompiler), and reported against the same field.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import orjson

from vt.http.disconnects import unless_disconnected
from vt.http.engine_client import EngineClient
from vt.http.protocol import ProtocolError
from vt.sampling_params import SamplingParams
from vt.structured.compiler import GrammarError
from vt.structured.spec import DEFAULT_JSON_WHITESPACE, GrammarSpec, StructuredOutput

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def json_text(value: Any, param: str) -> str:
    """value as compact JSON text; a 400 naming param where it nests deeper than the serializer
    goes (the body parser accepts deeper documents than orjson writes)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError as e:
        raise ProtocolError(f"'{param}' cannot be used: {e} (nested too deep)", param) from None


@dataclass(frozen=True)
class StructuredField:
    spec: GrammarSpec
    param: str          # the request field that asked for it (errors name it)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as its JSON text -> canonical text (key order kept:
    properties are generated in the schema's order)."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as e:
            raise ProtocolError(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise ProtocolError(f"'{param}' must be a JSON schema object", param)
    return json_text(value, param)


def _choice_text(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ProtocolError(f"'{param}' must be a non-empty list of non-empty strings", param)
    return json_text(value, param)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"'{param}' must be a non-empty string", param)
    return value


def _spec(kind: str, value: Any, param: str, whitespace: str = DEFAULT_JSON_WHITESPACE,
          strict: bool = False) -> GrammarSpec:
    if kind == "json":
        text = _schema_text(value, param)
    elif kind == "choice":
        text = _choice_text(value, param)
    elif kind == "json_object":
        text = ""
    else:
        text = _text(value, param)
    return GrammarSpec(kind, text, whitespace=whitespace, strict=strict)


def _flag(obj: dict[str, Any], name: str, param: str, where: str | None = None) -> bool:
    """A boolean option of the object at `where` (default: the field itself)."""
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError(f"'{where or param}.{name}' must be a boolean, got {value!r}", param)
    return bool(value)


def _whitespace(pattern: Any, param: str, none: bool = False) -> str:
    if none:
        return ""
    if pattern is None:
        return DEFAULT_JSON_WHITESPACE
    if not isinstance(pattern, str):
        raise ProtocolError(f"'{param}' must be a string (a regex), got {pattern!r}", param)
    return pattern


def _response_format(value: Any) -> GrammarSpec | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise ProtocolError("'response_format' must be an object", param)
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _spec("json_object", None, param)
    if kind == "json_schema":
        json_schema = value.get("json_schema")
        if not isinstance(json_schema, dict):
            raise ProtocolError("'response_format.json_schema' must be an object with a 'schema'", param)
        name = json_schema.get("name")
        if not isinstance(name, str) or not name:  # OpenAI's and vLLM's: a schema is named
            raise ProtocolError("'response_format.json_schema.name' is required: a non-empty string", param)
        schema = json_schema.get("schema")
        if schema is None:
            raise ProtocolError("'response_format.json_schema.schema' is required", param)
        if not isinstance(schema, dict):  # here an object, not its JSON text (guided_json takes both)
            raise ProtocolError("'response_format.json_schema.schema' must be a JSON schema object", param)
        strict = _flag(json_schema, "strict", param, "response_format.json_schema")
        return _spec("json", schema, param, strict=strict)
    raise ProtocolError("'response_format.type' must be 'text', 'json_object' or 'json_schema', got "
                        f"{kind!r}", param)


def _structured_outputs(value: Any) -> GrammarSpec:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise ProtocolError("'structured_outputs' must be an object", param)
    if value.get("structural_tag") is not None:
        raise ProtocolError("'structured_outputs.structural_tag' is not supported", param)
    given = [k for k in _STRUCTURED_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        which = ", ".join(given) if given else "none"
        raise ProtocolError(f"'structured_outputs' needs exactly one of {', '.join(_STRUCTURED_KINDS)} "
                            f"(got {which})", param)
    kind = given[0]
    if kind == "json_object" and value[kind] is not True:
        raise ProtocolError("'structured_outputs.json_object' must be true", param)
    whitespace = _whitespace(value.get("whitespace_pattern"), param,
                             none=_flag(value, "disable_any_whitespace", param))
    strict = _flag(value, "disable_additional_properties", param)
    _flag(value, "disable_fallback", param)  # vt has one grammar engine: nothing to fall back to
    return _spec(kind, value[kind], f"{param}.{kind}", whitespace, strict)


def parse_structured_fields(body: dict[str, Any]) -> StructuredField | None:
    """The request's structured-output constraint, or None; ProtocolError for a malformed field
    or for two constraints in one request."""
    found: list[StructuredField] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(StructuredField(spec, "response_format"))
    if body.get("structured_outputs") is not None:
        found.append(StructuredField(_structured_outputs(body["structured_outputs"]), "structured_outputs"))
    whitespace = _whitespace(body.get("guided_whitespace_pattern"), "guided_whitespace_pattern")
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append(StructuredField(_spec(kind, body[name], name, whitespace), name))
    if len(found) > 1:
        raise ProtocolError(f"'{found[1].param}' and '{found[0].param}' both constrain the output; give one",
                            found[1].param)
    return found[0] if found else None


async def constrain(engine: EngineClient, params: SamplingParams, field: StructuredField | None,
                    start_after: int | None = None,
                    disconnected: asyncio.Event | None = None) -> SamplingParams:
    """params with the field's grammar, compiled by the engine off the event loop; a grammar
    that does not compile is a 400 naming the field. A client that goes away while its grammar
    compiles cancels the compile (the compiler then stops its child and frees its place, unless
    another request waits for the same grammar) and gets a 499."""
    if field is None:
        return params
    compiling = engine.compile_grammar(field.spec)
    try:
        await (compiling if disconnected is None else unless_disconnected(disconnected, compiling))
    except GrammarError as e:
        raise ProtocolError(f"'{field.param}': {e}", field.param) from None
    return replace(params, structured=StructuredOutput(field.spec, start_after))
