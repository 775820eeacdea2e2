"""An incremental scanner of one JSON object's text: where each top-level value starts and ends.

Tool calls stream their arguments as the model writes them. The scanner reads each character
once, as it arrives, and tracks strings, escapes and nesting, so that at any moment the raw text
of a value written so far (`raw(key)`) is a prefix of its final text: streaming it in pieces
and reading it whole give the same arguments.
"""

from __future__ import annotations

import orjson

_WHITESPACE = " \t\r\n"


class ObjectScanner:
    def __init__(self) -> None:
        self.text = ""
        self.closed = False           # the object's closing brace was read
        self.invalid = False          # the text is not a JSON object
        self._values: dict[str, list] = {}   # key -> [start, end or None] in self.text
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._expect = "open"         # open | key | key_str | colon | value | value_str | nested | next
        self._key_start = 0
        self._key = ""
        self._scalar = False          # a top-level number / true / false / null is being read

    def feed(self, chunk: str) -> int:
        """Read chunk; returns how many of its characters belong to the object (all of them,
        unless the object closed or turned out invalid inside the chunk)."""
        base = len(self.text)
        self.text += chunk
        for n, c in enumerate(chunk):
            if self.closed or self.invalid:
                self.text = self.text[: base + n]
                return n
            self._step(c, base + n)
        return len(chunk)

    def raw(self, key: str) -> tuple[str, bool] | None:
        """(the value's text so far, whether it is complete), or None if the key has not come."""
        span = self._values.get(key)
        if span is None:
            return None
        start, end = span
        return (self.text[start:end], True) if end is not None else (self.text[start:], False)

    def string(self, key: str) -> str | None:
        """A complete string value, decoded; None otherwise."""
        got = self.raw(key)
        if got is None or not got[1] or not got[0].startswith('"'):
            return None
        return orjson.loads(got[0])

    def _end_value(self, end: int) -> None:
        self._values[self._key][1] = end
        self._expect = "next"

    def _step(self, c: str, i: int) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._expect == "key_str":
                    self._key = orjson.loads(self.text[self._key_start: i + 1])
                    self._expect = "colon"
                elif self._expect == "value_str":
                    self._end_value(i + 1)
            return
        if self._scalar:
            if c not in _WHITESPACE and c not in ",}":
                return
            self._scalar = False
            self._end_value(i)
        if c in _WHITESPACE:
            return
        if self._depth >= 2:  # inside a nested value: only its nesting matters
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._end_value(i + 1)
            return
        expect = self._expect
        if expect == "open" and c == "{":
            self._depth, self._expect = 1, "key"
        elif expect == "key" and c == '"':
            self._in_str, self._key_start, self._expect = True, i, "key_str"
        elif expect in ("key", "next") and c == "}":
            self._depth, self.closed = 0, True
        elif expect == "colon" and c == ":":
            self._expect = "value"
        elif expect == "value":
            self._values[self._key] = [i, None]
            if c == '"':
                self._in_str, self._expect = True, "value_str"
            elif c in "{[":
                self._depth, self._expect = 2, "nested"
            else:
                self._scalar = True
        elif expect == "next" and c == ",":
            self._expect = "key"
        else:
            self.invalid = True
