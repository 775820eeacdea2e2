"""A short, bounded rendering of a client's value for error messages.

`repr` of a client value is unbounded twice over: a 16 MB string is echoed whole, and a list
nested a thousand deep raises RecursionError. `preview` walks the value without recursion and
stops after `limit` characters.
"""

from __future__ import annotations

from typing import Any

PREVIEW_CHARS = 80


def preview(value: Any, limit: int = PREVIEW_CHARS) -> str:
    """JSON-like text of `value`, cut to about `limit` characters with '...' where cut."""
    out: list[str] = []
    size = 0
    # A stack of pending pieces: plain strings to write, or values to expand.
    stack: list[tuple[bool, Any]] = [(False, value)]
    while stack:
        if size > limit:
            return "".join(out)[:limit] + "..."
        literal, item = stack.pop()
        if literal:
            text = item
        elif isinstance(item, dict):
            parts: list[tuple[bool, Any]] = [(True, "{")]
            for i, (k, v) in enumerate(item.items()):
                if i * 4 > limit:  # each entry takes at least 4 characters
                    parts.append((True, ", ..."))
                    break
                parts += [(True, ", " if i else ""), (False, k), (True, ": "), (False, v)]
            parts.append((True, "}"))
            stack.extend(reversed(parts))
            continue
        elif isinstance(item, (list, tuple)):
            parts = [(True, "[")]
            for i, v in enumerate(item):
                if i * 2 > limit:
                    parts.append((True, ", ..."))
                    break
                parts += [(True, ", " if i else ""), (False, v)]
            parts.append((True, "]"))
            stack.extend(reversed(parts))
            continue
        elif isinstance(item, str):
            text = repr(item[: limit + 1])
        elif isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > 4 * limit:
            text = f"<an integer of {item.bit_length()} bits>"  # str() of a huge int is quadratic
        else:
            text = repr(item)
        out.append(text)
        size += len(text)
    text = "".join(out)
    return text if len(text) <= limit else text[:limit] + "..."
