"""The llguidance grammar of a GrammarSpec: JSON schemas (strict ones closed), regexes, choices,
Lark / GBNF grammars; text only, nothing compiled here.

Two shapes are written so that they compile where their plain form meets one of llguidance's
fixed limits:
- A choice is one lexeme (`start: CHOICE`, `CHOICE: "a" | "b" | ...`), not a rule of
  alternatives: the lexer reads it as a trie, where a rule put one Earley item per option in
  the first row (2,001 options broke the row limit) and one grammar symbol per option
  (about 65,000 options broke the symbol limit, with a panic).
- A large union at a JSON schema's root (`anyOf`, or an array whose items are an `anyOf`, as
  tool_choice required writes one branch per tool) is split into groups, each compiled as a
  JSON schema of its own under a Lark rule that alternates them: llguidance stops a schema
  after 50,000 compiled nodes ("schema too large", about 2,900 small tools), and that budget is
  per schema. The language is the same: each group keeps the root's `$defs` and whitespace,
  and the array's brackets and commas take the same whitespace as JSON's.
"""

from __future__ import annotations

from typing import Any

import orjson

from vt.structured.spec import GrammarError, GrammarSpec

# JSON schema keywords whose values are schemas, maps of schemas or lists of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "additionalItems")
_DEFS = ("$defs", "definitions")
_ANNOTATIONS = frozenset(("title", "description", "$schema", "$comment", "examples", "default"))
# Schema objects per group of a split union. A small tool's call (name and a few parameters)
# is ~5 objects and ~17 of llguidance's 50,000 compiled nodes: 4,000 objects leave room for
# the `$defs` a group compiles again and for schemas that compile to more nodes per object.
GROUP_OBJECTS = 4_000


def close_objects(schema: Any) -> Any:
    """A copy of a JSON schema where every object schema that does not say otherwise gets
    additionalProperties false: OpenAI's `strict` (which requires it) and vLLM's
    disable_additional_properties. Walks only keywords that hold schemas, so a property that
    happens to be named "properties" or "type" is left alone."""
    if isinstance(schema, list):  # "items" in its old tuple form
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = close_objects(out[key])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (is_object or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lark_string(text: str) -> str:
    return orjson.dumps(text).decode()  # JSON string escapes are Lark's


def choice_grammar(choices: Any) -> str:
    """A grammar whose outputs are exactly the given strings, as one lexeme."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("a choice must be a non-empty list of strings")
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(
        "start: CHOICE\nCHOICE: " + " | ".join(_lark_string(c) for c in dict.fromkeys(choices)))


def _count_objects(schema: Any) -> int:
    """Dicts in a JSON value (walked with a stack: a deep schema must not recurse here)."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            count += 1
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def _root_union(schema: dict[str, Any]) -> tuple[list[Any], dict[str, Any] | None] | None:
    """(the branches, the array's bounds or None for a bare union) of a schema that is a union
    at its root, or an array of one; None for any other schema."""
    def only(node: dict[str, Any], allowed: set[str]) -> bool:
        return all(k in allowed or k in _ANNOTATIONS for k in node)

    defs = set(_DEFS)
    if isinstance(schema.get("anyOf"), list) and only(schema, {"anyOf", *defs}):
        return schema["anyOf"], None
    items = schema.get("items")
    if (schema.get("type") == "array" and isinstance(items, dict) and isinstance(items.get("anyOf"), list)
            and only(items, {"anyOf"}) and only(schema, {"type", "items", "minItems", "maxItems", *defs})):
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        bounds_ok = (isinstance(lo, int) and not isinstance(lo, bool) and lo >= 0
                     and (hi is None or (isinstance(hi, int) and not isinstance(hi, bool) and hi >= lo)))
        if bounds_ok:
            return items["anyOf"], {"min": lo, "max": hi}
    return None


def _groups(branches: list[Any]) -> list[list[Any]]:
    groups: list[list[Any]] = [[]]
    size = 0
    for branch in branches:
        n = _count_objects(branch)
        if groups[-1] and size + n > GROUP_OBJECTS:
            groups.append([])
            size = 0
        groups[-1].append(branch)
        size += n
    return groups


def _array_rule(bounds: dict[str, Any]) -> str:
    """`start` of an array of `item`s, from minItems to maxItems of them."""
    lo, hi = bounds["min"], bounds["max"]
    if hi == 0:
        return 'start: "[" "]"'
    rest_lo, rest_hi = max(lo - 1, 0), (None if hi is None else hi - 1)
    rest = "" if rest_hi == 0 else f' ("," item){{{rest_lo},{"" if rest_hi is None else rest_hi}}}'
    filled = f'"[" item{rest} "]"'
    return f"start: {filled}" if lo > 0 else f'start: "[" "]" | {filled}'


def _split_union(schema: dict[str, Any], options: dict[str, Any]) -> str | None:
    """The Lark grammar of a large root union split into groups; None where the schema is not
    such a union or is small enough to compile whole."""
    union = _root_union(schema)
    if union is None:
        return None
    branches, bounds = union
    if _count_objects(branches) <= GROUP_OBJECTS:
        return None
    import llguidance

    defs = {k: schema[k] for k in _DEFS if k in schema}
    lines = []
    if "whitespace_pattern" in options:  # JSON takes one match of it between tokens: so here
        lines += [f"%ignore /{llguidance.regex_to_lark(options['whitespace_pattern'], '')}/",
                  '%llguidance {"ignore_once": true}']
    names = []
    for i, group in enumerate(_groups(branches)):
        sub = {"anyOf": group, **defs, "x-guidance": options}
        names.append(f"group{i}")
        lines.append(f"group{i}: %json {orjson.dumps(sub).decode()}")
    if bounds is None:
        lines.append("start: " + " | ".join(names))
    else:
        lines.append("item: " + " | ".join(names))
        lines.append(_array_rule(bounds))
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


def json_grammar(schema: Any, options: dict[str, Any]) -> str:
    """The grammar of a JSON schema under llguidance's JSON options (whitespace)."""
    import llguidance

    if isinstance(schema, dict):
        split = _split_union(schema, options)
        if split is not None:
            return split
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (not compiled yet); GrammarError for unreadable input."""
    import llguidance

    if spec.kind in ("json", "json_object"):
        if spec.kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = orjson.loads(spec.text)
            except orjson.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object")
            if spec.strict:
                schema = close_objects(schema)
        options = ({"whitespace_flexible": False} if spec.whitespace == ""
                   else {"whitespace_pattern": spec.whitespace})
        return json_grammar(schema, options)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        try:
            choices = orjson.loads(spec.text)
        except orjson.JSONDecodeError:
            raise GrammarError("a choice must be a JSON list of strings") from None
        return choice_grammar(choices)
    try:
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(str(e)) from None
