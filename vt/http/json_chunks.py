"""JSON bodies written in pieces, with their largest arrays built item by item as they go out.

A non-streamed answer of n=128 choices with 20 top logprobs a token runs to tens of megabytes:
built and serialised in one go it holds the loop for as long and sits in memory whole. Here the
body is a skeleton of dicts and lists whose big arrays are `LazyList`s; `json_chunks` walks it
and yields about `chunk_bytes` at a time, building each lazy item only when its turn comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson

CHUNK_BYTES = 64 * 1024


class LazyList:
    """A JSON array of `length` items, item i made by `item(i)` when it is written (in order)."""

    __slots__ = ("length", "item")

    def __init__(self, length: int, item: Callable[[int], Any]) -> None:
        self.length = length
        self.item = item

    def materialize(self) -> list[Any]:
        return [self.item(i) for i in range(self.length)]


def _pieces(obj: Any) -> Iterator[bytes]:
    # The skeleton is walked; lazy items and leaves go to orjson whole.
    if isinstance(obj, dict):
        yield b"{"
        for i, (key, value) in enumerate(obj.items()):
            yield (b"," if i else b"") + orjson.dumps(str(key)) + b":"
            yield from _pieces(value)
        yield b"}"
    elif isinstance(obj, (list, tuple)):
        yield b"["
        for i, value in enumerate(obj):
            if i:
                yield b","
            yield from _pieces(value)
        yield b"]"
    elif isinstance(obj, LazyList):
        yield b"["
        for i in range(obj.length):
            yield (b"," if i else b"") + orjson.dumps(obj.item(i))
        yield b"]"
    else:
        yield orjson.dumps(obj)


def json_chunks(obj: Any, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The JSON text of obj (dicts, lists, LazyLists, orjson-serialisable leaves) in pieces of
    about chunk_bytes; joined, they equal orjson.dumps of the materialized object."""
    pending = bytearray()
    for piece in _pieces(obj):
        pending += piece
        if len(pending) >= chunk_bytes:
            yield bytes(pending)
            pending.clear()
    if pending:
        yield bytes(pending)
