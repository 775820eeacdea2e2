"""What a request asks its output to follow, as plain data: the compile cache's key.

No llguidance here: SamplingParams carries a StructuredOutput, and the scheduler, the runner and
the HTTP layer can hold one without loading the grammar engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON whitespace between tokens when the request does not choose: one space, or a line break and
# up to 20 spaces of indentation, so compact and pretty-printed JSON both fit. Unbounded whitespace
# (vLLM's default) lets a model that hesitates emit blank lines until max_tokens; this cannot loop.
DEFAULT_JSON_WHITESPACE = r"(?:[ ]|\n[ ]{0,20})?"


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled; the message says why."""


class GrammarUnavailableError(RuntimeError):
    """No grammar can be compiled now (the server is stopping): not the request's fault."""


MAX_ERROR_CHARS = 500
# llguidance's own failures (a Rust panic) name an internal assertion; this one is a size limit.
_SYMBOL_LIMIT = "grammar.symbols.len() < u16::MAX"


def error_line(text: str) -> str:
    """The client's part of a grammar engine message, on one line: its first line (the reason),
    with the detail line of a regex error ("error: unclosed group") where it has one. llguidance
    goes on with the grammar's text, its parser state or a panic's backtrace."""
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    if not lines:
        return "rejected"
    if _SYMBOL_LIMIT in lines[0]:
        return "the grammar is too large: it needs more than 65,000 grammar symbols"
    first = lines[0]
    if first.startswith("panic:"):
        first = f"the grammar engine failed on this grammar ({first[6:].strip()})"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    if first.endswith(":") and detail is not None:
        first = f"{first} {detail[6:].strip()}"
    return first if len(first) <= MAX_ERROR_CHARS else first[: MAX_ERROR_CHARS - 3] + "..."


def matcher_error(matcher: Any) -> str:
    """The reason a matcher is in error, on one line (error_line)."""
    return error_line(matcher.get_error() or "")


@dataclass(frozen=True)
class GrammarSpec:
    """kind: json (text is a JSON schema), json_object (any JSON object; text unused), regex,
    choice (text is a JSON list of strings, one of which is the output) or grammar (Lark, or
    GBNF / EBNF as llama.cpp and vLLM write them)."""

    kind: str
    text: str = ""
    whitespace: str = DEFAULT_JSON_WHITESPACE  # json kinds: regex of the whitespace between tokens
    strict: bool = False                        # json: objects without additionalProperties get false

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.text, str) or not isinstance(self.whitespace, str):
            raise ValueError("grammar text and whitespace must be strings")


@dataclass(frozen=True)
class StructuredOutput:
    """A request's constraint: its grammar, applied from the first output token, or only after
    the token `start_after` (a reasoning parser's end-of-thinking token) has been generated."""

    grammar: GrammarSpec
    start_after: int | None = None
