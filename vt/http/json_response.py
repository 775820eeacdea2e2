"""JSON answers: small ones whole, large ones chunked and built as they are written."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson

from vt.http.json_chunks import json_chunks
from vt.http.messages import Response, StreamResponse

INLINE_BODY_BYTES = 1 << 20  # larger answers go out chunked, built as they are written


def json_response(obj: Any, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(status, orjson.dumps(obj), headers=headers or [])


async def _body_rest(head: list[bytes], rest: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in head:
        yield chunk
    for chunk in rest:  # each piece is built when the previous one is written
        yield chunk


def json_body(obj: Any) -> Response | StreamResponse:
    """A JSON answer: whole with a Content-Length when small, else chunked and built lazily."""
    chunks = json_chunks(obj)
    head: list[bytes] = []
    size = 0
    for chunk in chunks:
        head.append(chunk)
        size += len(chunk)
        if size > INLINE_BODY_BYTES:
            return StreamResponse(200, _body_rest(head, chunks), content_type="application/json")
    return Response(200, b"".join(head))
