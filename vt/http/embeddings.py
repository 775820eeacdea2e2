"""POST /v1/embeddings: OpenAI's embeddings API over an embedding model (the pooling runner).

`input` is a string, a list of strings, a list of token ids or a list of token-id lists; each
becomes one engine request (AsyncEngine.embed) and one vector, in input order. `dimensions`
truncates a Matryoshka model's vectors (a 400 naming the field elsewhere, as vLLM answers);
`encoding_format` is float (JSON numbers) or base64 (the float32 values little-endian, which
OpenAI's client decodes, and asks for by default); `user` is accepted. vLLM's extras are read as
there: `add_special_tokens`, `truncate_prompt_tokens` and `priority`. The answer is OpenAI's
list of `embedding` objects with usage (prompt_tokens, total_tokens).

A server runs one runner: an embedding model's server answers the generation routes with a 404
naming the runner, and a generative model's answers this route so (`unserved_routes`).
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from vt.engine.admission import check_priority
from vt.engine.outputs import RequestOutput, RequestStream
from vt.http.choices import close_streams, engine_failure, merge_outputs
from vt.http.disconnects import unless_disconnected
from vt.http.engine_client import PoolingClient
from vt.http.errors import HttpError
from vt.http.generation import engine_error
from vt.http.json_chunks import LazyList
from vt.http.json_response import json_body
from vt.http.messages import HttpRequest, Response, StreamResponse
from vt.http.protocol import ProtocolError, get_bool, get_int, get_str, parse_json_object
from vt.http.route_context import RouteContext
from vt.model.pooling import PoolingConfig
from vt.text.preview import preview

log = logging.getLogger("vt.http")

MAX_INPUTS = 2048  # inputs in one request, OpenAI's bound
ENCODING_FORMATS = ("float", "base64")
EMBEDDINGS_PATH = "/v1/embeddings"
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
Handler = Callable[[HttpRequest], Awaitable[Response | StreamResponse]]


@dataclass(frozen=True)
class EmbeddingRequest:
    """An embeddings body, read and checked."""

    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]  # each text to encode, or token ids as given
    encoding_format: str
    dimensions: int | None
    add_special_tokens: bool
    truncate_prompt_tokens: int | None         # keep each input's last k tokens; -1: max-model-len
    priority: int


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_input(value: Any) -> str | tuple[int, ...] | None:
    """A text or a non-empty list of token ids (each >= 0); None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_int(i) for i in value):
        if any(i < 0 for i in value):
            raise ProtocolError("'input' token ids must be >= 0", "input")
        return tuple(value)
    return None


def parse_inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's `input`: a string, a list of token ids, or a batch (a list of strings or a list
    of token-id lists)."""
    if value is None:
        raise ProtocolError("'input' is required", "input")
    if isinstance(value, list) and not value:
        raise ProtocolError("'input' must not be empty", "input")
    one = _one_input(value)
    if one is not None:
        return (one,)
    if isinstance(value, list) and (all(isinstance(v, str) for v in value)
                                    or all(isinstance(v, list) for v in value)):
        if len(value) > MAX_INPUTS:
            raise ProtocolError(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} per request",
                                "input")
        batch = tuple(_one_input(v) for v in value)
        if None not in batch:
            return batch  # type: ignore[return-value]
    raise ProtocolError("'input' must be a string, a list of token ids, or a list of strings or of "
                        "token-id lists", "input")


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    if body.get("input") is None and body.get("messages") is not None:
        # vLLM's chat-style embedding request: asked for, it would be ignored, so it is refused
        raise ProtocolError("chat-style embedding requests ('messages') are not supported; send 'input'",
                            "messages")
    inputs = parse_inputs(body.get("input"))
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODING_FORMATS:
        raise ProtocolError(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got "
                            f"{preview(encoding)}", "encoding_format")
    dimensions = get_int(body, "dimensions")
    if dimensions is not None and dimensions < 1:
        raise ProtocolError(f"'dimensions' must be at least 1, got {dimensions}", "dimensions")
    truncate = get_int(body, "truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise ProtocolError(f"'truncate_prompt_tokens' must be at least 1, or -1 for the maximum context "
                            f"length, got {truncate}", "truncate_prompt_tokens")
    get_str(body, "user")  # accepted and unused, but a string as OpenAI documents it
    return EmbeddingRequest(model=get_str(body, "model"), inputs=inputs, encoding_format=encoding,
                            dimensions=dimensions,
                            add_special_tokens=get_bool(body, "add_special_tokens", True),
                            truncate_prompt_tokens=truncate, priority=get_int(body, "priority", 0) or 0)


def encode_vector(vector: np.ndarray, encoding_format: str) -> Any:
    """One vector as the response carries it: JSON numbers (each float32 value written in its
    shortest form), or base64 of its little-endian float32 bytes."""
    v = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(v.tobytes()).decode("ascii")
    return orjson.Fragment(orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY))


class EmbeddingsRoute:
    def __init__(self, context: RouteContext) -> None:
        self._context = context

    def _pooling_engine(self) -> tuple[PoolingClient, PoolingConfig]:
        engine = self._context.engine
        pooling = engine.pooling if isinstance(engine, PoolingClient) else None
        if pooling is None:
            raise _not_served(EMBEDDINGS_PATH, pooling=False)
        return engine, pooling

    async def handle(self, http_request: HttpRequest) -> Response | StreamResponse:
        context = self._context
        engine, pooling = self._pooling_engine()
        request = parse_embedding_request(parse_json_object(http_request.body))
        context.check_model(request.model)
        limits = context.engine.limits
        check_priority(request.priority, limits)
        if len(request.inputs) > limits.max_waiting:
            raise ProtocolError(f"the request holds {len(request.inputs)} inputs, more than the waiting "
                                f"queue holds ({limits.max_waiting}), so it could never be admitted; send "
                                f"fewer inputs per request", "input")
        pooling.check_dimensions(request.dimensions, engine.model_config.hidden_size,
                                 context.served_model_name)
        prompts = [self._fit(await self._context.prompt_ids(x, "input", request.add_special_tokens), request)
                   for x in request.inputs]
        response_id = f"embd-{uuid.uuid4().hex}"
        streams = self._start(engine, response_id, prompts, request)
        options = context.options
        if options.log_requests and log.isEnabledFor(options.request_log_level):
            log.log(options.request_log_level, "request %s: embedding input tokens %s, priority %d, "
                    "dimensions %s", response_id, [len(p) for p in prompts], request.priority,
                    request.dimensions)
        outputs = await _collect(http_request, streams)
        vectors = [out.embedding for out in outputs]
        num_tokens = sum(map(len, prompts))

        def item(i: int) -> dict[str, Any]:  # built as it is written
            return {"index": i, "object": "embedding",
                    "embedding": encode_vector(vectors[i], request.encoding_format)}

        return json_body({
            "id": response_id, "object": "list", "created": int(time.time()),
            "model": context.served_model_name,
            "data": LazyList(len(vectors), item),
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
        })

    def _fit(self, ids: list[int], request: EmbeddingRequest) -> list[int]:
        """The input truncated as asked (vLLM's truncate_prompt_tokens: its last k tokens), or a
        400 naming `input` when it is longer than the context or the KV cache can hold."""
        limits = self._context.engine.limits
        mml = limits.max_model_len
        k = request.truncate_prompt_tokens
        if k is not None:
            if k > mml:
                raise ProtocolError(f"'truncate_prompt_tokens' ({k}) is greater than this model's maximum "
                                    f"context length ({mml})", "truncate_prompt_tokens")
            ids = ids[-(mml if k == -1 else k):]
        if len(ids) > mml:
            raise ProtocolError(f"the input has {len(ids)} tokens; this model's maximum context length is "
                                f"{mml} tokens", "input")
        if limits.kv_tokens is not None and len(ids) > limits.kv_tokens:
            raise ProtocolError(f"the input has {len(ids)} tokens and the server's KV cache holds "
                                f"{limits.kv_tokens}; send a shorter input", "input")
        return ids

    def _start(self, engine: PoolingClient, response_id: str, prompts: list[list[int]],
               request: EmbeddingRequest) -> list[RequestStream]:
        """One engine request per input; on any failure the ones already added are aborted."""
        count = len(prompts)
        request_ids = [response_id] if count == 1 else [f"{response_id}-{i}" for i in range(count)]
        streams: list[RequestStream] = []
        try:
            for request_id, ids in zip(request_ids, prompts, strict=True):
                streams.append(engine.embed(request_id, ids, dimensions=request.dimensions,
                                            priority=request.priority))
        except Exception as e:
            for request_id in request_ids[:len(streams)]:
                self._context.engine.abort(request_id)
            mapped = engine_error(e)
            if mapped is None:
                raise
            raise mapped from None
        return streams


async def _collect(http_request: HttpRequest, streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's finishing output, in input order; a client that goes away aborts them (a
    499), an input the engine failed fails the answer."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def drain() -> None:
        async for i, out in merge_outputs(streams):
            if out.finished:
                finals[i] = out

    try:
        await unless_disconnected(http_request.disconnected, drain())
    finally:
        await close_streams(streams)
    outputs = [out for out in finals if out is not None]
    failed = [out for out in outputs if out.finish_reason == "error" or out.embedding is None]
    if failed or len(outputs) != len(streams):
        first = failed[0] if failed else None
        raise engine_failure(first.error if first else None, first.error_kind if first else None)
    return outputs


def _not_served(path: str, pooling: bool) -> HttpError:
    """A route the server's runner does not serve, as vLLM (which registers a runner's routes
    only) answers it: a 404, here naming the runner and what to do instead."""
    if pooling:
        why = (f"{path} is not served: this server runs an embedding model (--runner pooling), which "
               f"generates no text; use {EMBEDDINGS_PATH}")
    else:
        why = (f"{path} is not served: this server runs a generative model (--runner generate), which "
               f"has no embeddings; serve an embedding model, or start with --runner pooling")
    return HttpError(404, why, type="not_found_error", code="not_found")


def unserved_routes(engine: object, paths: Sequence[str]) -> dict[str, Handler]:
    """The routes of `paths` this engine's runner does not serve, each with a handler answering
    so: the generation routes on an embedding model's server, /v1/embeddings on a generative
    one (or on an engine that has no embeddings at all)."""
    pooling = isinstance(engine, PoolingClient) and engine.pooling is not None
    unserved = GENERATION_ROUTES if pooling else (EMBEDDINGS_PATH,)

    def refuse(path: str) -> Handler:
        async def handler(request: HttpRequest) -> Response:
            raise _not_served(path, pooling)
        return handler

    return {path: refuse(path) for path in paths if path in unserved}
