"""The jinja2 sandbox chat templates run in: transformers' (immutable sandbox, its filters and
globals), with no constant folding and with bounds on the operations that make big values.

Jinja evaluates constant expressions while it *compiles* a template and writes the result into
the generated Python source: `{{ 'x' * 10**9 }}` built a 1 GB string, then a 1 GB source file
to compile, outside any render's guard. Here the operators that can make a value much larger
than their operands (`*`, `**`, `%`) are intercepted, which also keeps Jinja from folding them,
and so are the filters that can (center, indent, format, replace, join: they take the context,
and Jinja folds only filters that do not). What is left to fold is no larger than the source
(`+` of two literals, a filter of a literal). At render time those operators and filters, and
the widening string methods (center, ljust, rjust, zfill, expandtabs, join, replace, format),
refuse a value past MAX_VALUE_SIZE characters or items, and integers past MAX_INT_BITS bits,
before making it.

These bounds keep a mistake cheap; they are not a wall. A request's own template is rendered in
a child process with hard time and memory limits (template_process.py).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable
from datetime import datetime
from typing import Any

MAX_VALUE_SIZE = 1 << 24      # characters of a string, items of a list, made by one operation
MAX_INT_BITS = 1 << 16        # bits of an integer made by * or ** (about 19,700 digits)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_WIDENING_METHODS = frozenset(("center", "ljust", "rjust", "zfill", "expandtabs"))


class TemplateBoundError(ValueError):
    """A template operation would have made a value past the sandbox's bounds."""


def _too_big(size: int, what: str) -> None:
    if size > MAX_VALUE_SIZE:
        raise TemplateBoundError(f"{what} would make a value of {size:,} characters or items "
                                 f"(at most {MAX_VALUE_SIZE:,})")


def _check_widths(numbers: list[str], what: str) -> None:
    _too_big(sum(int(n) for n in numbers if n.isdigit()), what)


def _check_percent(fmt: str, args: Any) -> None:
    """Bound `fmt % args`: its widths and precisions (and any given through `*`)."""
    specs = _PERCENT_SPEC.findall(fmt)
    _check_widths([n for spec in specs for n in spec], "'%' formatting")
    if any("*" in spec for spec in specs):
        values = args if isinstance(args, tuple) else (args,)
        _check_widths([str(v) for v in values if isinstance(v, int) and v > 0], "'%' formatting")


def _check_format(fmt: str) -> None:
    """Bound str.format's widths (the format string's own; nested ones are read from arguments)."""
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    except ValueError:
        return  # str.format itself reports the bad format string
    _check_widths([n for spec in specs for n in re.findall(r"\d+", spec)], "format()")


def _bounded_binop(op: str, left: Any, right: Any) -> None:
    """Raise TemplateBoundError where `left op right` would be past the bounds."""
    if op == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                _too_big(len(seq) * max(count, 0), "'*'")
        if isinstance(left, int) and isinstance(right, int) and \
                left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateBoundError(f"'*' would make an integer of more than {MAX_INT_BITS:,} bits")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 and \
                left.bit_length() * right > MAX_INT_BITS:
            raise TemplateBoundError(f"'**' would make an integer of more than {MAX_INT_BITS:,} bits")
    elif op == "%" and isinstance(left, str):
        _check_percent(left, right)


def _joined_size(items: Any, sep: str) -> int:
    items = list(items)
    return sum(len(str(x)) for x in items) + len(sep) * max(len(items) - 1, 0)


def _bounded_filters(filters: dict[str, Callable[..., Any]]) -> None:
    """The filters that can widen a value, with a size check first. Each takes the context, so
    Jinja never runs one while compiling (`'x'|center(999999999)` is folded otherwise)."""
    import jinja2

    center, indent, fmt = filters["center"], filters["indent"], filters["format"]
    replace, join = filters["replace"], filters["join"]

    @jinja2.pass_context
    def bounded_center(context: Any, value: Any, width: int = 80) -> str:
        _too_big(width if isinstance(width, int) else 0, "center")
        return center(value, width)

    @jinja2.pass_context
    def bounded_indent(context: Any, s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> str:
        text = str(s)
        pad = width if isinstance(width, int) else len(str(width))
        _too_big(len(text) + pad * (text.count("\n") + 1), "indent")
        return indent(s, width, *args, **kwargs)

    @jinja2.pass_context
    def bounded_format(context: Any, value: Any, *args: Any, **kwargs: Any) -> str:
        _check_percent(str(value), args or kwargs)
        return fmt(value, *args, **kwargs)

    @jinja2.pass_context
    def bounded_replace(context: Any, s: Any, old: Any, new: Any, count: int | None = None) -> str:
        text, old_s, new_s = str(s), str(old), str(new)
        times = (text.count(old_s) if old_s else len(text) + 1)
        if count is not None and count >= 0:
            times = min(times, count)
        _too_big(len(text) + times * max(len(new_s) - len(old_s), 0), "replace")
        return replace(context.eval_ctx, s, old, new, count)

    @jinja2.pass_context
    def bounded_join(context: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        if attribute is None and isinstance(value, (list, tuple)):
            _too_big(_joined_size(value, str(d)), "join")
        return join(context.eval_ctx, value, d, attribute)

    filters.update(center=bounded_center, indent=bounded_indent, format=bounded_format,
                   replace=bounded_replace, join=bounded_join)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def new_environment(raise_exception: Callable[[str], None]) -> Any:
    """A bounded sandbox with transformers' settings, filters and globals; templates call
    `raise_exception(message)` to refuse a conversation."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(("*", "**", "%"))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _bounded_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            name = getattr(__obj, "__name__", None)
            if isinstance(getattr(__obj, "__self__", None), str):
                if name in _WIDENING_METHODS:
                    _check_widths([str(a) for a in args if isinstance(a, int) and a > 0], f"str.{name}")
                elif name == "join" and args:
                    _too_big(_joined_size(args[0], __obj.__self__), "str.join")
                elif name == "replace" and len(args) >= 2:
                    text, old, new = __obj.__self__, str(args[0]), str(args[1])
                    times = text.count(old) if old else len(text) + 1
                    _too_big(len(text) + times * max(len(new) - len(old), 0), "str.replace")
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_format(value.__self__)
            return wrapped

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    _bounded_filters(env.filters)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
