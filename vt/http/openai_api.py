"""OpenAI-compatible routes over the async engine: completions, chat, models, tokenize, metrics.

The app is a single `handle(HttpRequest)` coroutine the HTTP server calls; it validates the body
(vt.http.protocol), fans a request out into n engine requests, and shapes results and SSE chunks
the way OpenAI clients (and vLLM's extras) expect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson

from vt.engine.admission import AdmissionLimits, check_params, check_priority, fit_context
from vt.engine.outputs import (
    EngineDeadError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    RequestStream,
    TokenLogprob,
)
from vt.http import metrics
from vt.http.api_options import ApiOptions
from vt.http.chat_body import fields_given, parse_chat_body
from vt.http.chat_options import ChatTemplateOptions, parse_template_options
from vt.http.chat_output import ChatOutputPlan
from vt.http.engine_client import EngineClient
from vt.http.errors import HttpError, error_body
from vt.http.json_chunks import LazyList, json_chunks
from vt.http.prompt_prep import PromptPreparer
from vt.http.protocol import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    ProtocolError,
    get_bool,
    get_str,
    params_for_choice,
    parse_completion_request,
    parse_json_object,
    parse_messages,
)
from vt.http.reasoning import ReasoningParser
from vt.http.server import HttpRequest, PushBody, Response, StreamResponse
from vt.http.structured_fields import constrain, parse_structured_fields
from vt.sampling_params import SamplingParams, SamplingParamsError
from vt.text.preview import preview

log = logging.getLogger("vt.http")

# chat logprobs must be JSON numbers; -inf (a masked token) becomes vLLM's floor value
LOGPROB_FLOOR = -9999.0
DONE = b"data: [DONE]\n\n"
INLINE_BODY_BYTES = 1 << 20  # larger answers go out chunked, built as they are written
Handler = Callable[[HttpRequest], Awaitable["Response | StreamResponse"]]
RequestT = TypeVar("RequestT", bound=GenerationRequest)


class ResponseCounts(Protocol):
    """The HTTP server as /metrics reads it."""

    responses_total: dict[int, int]


def _json(obj: Any, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(status, orjson.dumps(obj), headers=headers or [])


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_HOLE = "\x00vt-text\x00"


class _TextEvents:
    """The SSE event of a plain token (no logprobs, not the last), byte for byte what _sse would
    make of `event(index, text)`: the bytes around the text are serialised once per choice and
    only the text is encoded per token, instead of a dict of dicts."""

    def __init__(self, event: Callable[[int, str], dict[str, Any]]) -> None:
        self._event = event
        self._parts: dict[int, list[bytes]] = {}

    def __call__(self, index: int, text: str) -> bytes:
        parts = self._parts.get(index)
        if parts is None:
            parts = self._parts[index] = _sse(self._event(index, _HOLE)).split(orjson.dumps(_HOLE))
        if len(parts) != 2:  # the marker occurs elsewhere too (a model named so): no shortcut
            return _sse(self._event(index, text))
        return parts[0] + orjson.dumps(text) + parts[1]


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def _version() -> str:
    from vt import __version__

    return __version__


def _engine_error(error: Exception) -> HttpError | None:
    """add_request's errors as HTTP errors (None: not the request's fault, a 500)."""
    if isinstance(error, PromptTooLongError):
        return HttpError(400, str(error))
    if isinstance(error, QueueFullError):
        return HttpError(503, str(error) or "the waiting queue is full; retry later", type="server_busy",
                         headers=[("retry-after", "1")])
    if isinstance(error, EngineDeadError):
        return HttpError(503, str(error) or "the engine has stopped", type="service_unavailable")
    if isinstance(error, ValueError):
        return HttpError(400, str(error), param=getattr(error, "param", None))
    return None


@dataclass
class _Choice:
    """Accumulated state of one of the n engine requests behind a response."""

    index: int
    request_id: str
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_output_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    text_offset: int = 0   # characters streamed so far, for completions text_offset

    def update(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error = out.error


async def _next(stream: RequestStream) -> RequestOutput:
    return await stream.__anext__()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (choice index, output) from several engine streams in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending: dict[asyncio.Future[RequestOutput], int] = {
        asyncio.ensure_future(_next(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                if not out.finished:
                    pending[asyncio.ensure_future(_next(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # retrieved so asyncio does not warn about it


async def _close_all(streams: list[RequestStream]) -> None:
    """Close every engine stream; closing an unfinished one aborts its request."""
    for s in streams:
        try:
            await s.aclose()
        except Exception:
            log.exception("closing a request stream failed")


@dataclass
class _Events:
    """The SSE events of one streamed response: `first` before any output, `output(i, out)` for
    each engine output of choice i (an error's events end with DONE: the stream stops there),
    `last()` once every choice has finished."""

    first: list[bytes]
    output: Callable[[int, RequestOutput], list[bytes]]
    last: Callable[[], list[bytes]]


async def _pull_events(streams: list[RequestStream], events: _Events) -> AsyncIterator[bytes]:
    for data in events.first:
        yield data
    async for i, out in _merge(streams):
        datas = events.output(i, out)
        for data in datas:
            yield data
        if datas and datas[-1] is DONE:
            return
    for data in events.last():
        yield data


class _SseBody:
    """The chunk iterator handed to the server; closing it aborts the engine requests.

    A plain async generator closed before its first step never runs its `finally`, so the
    cleanup lives here, where it runs whether or not streaming ever started.
    """

    def __init__(self, gen: AsyncIterator[bytes], streams: list[RequestStream], engine: EngineClient) -> None:
        self._gen = gen
        self._streams = streams
        self._engine = engine
        self._closed = False

    def __aiter__(self) -> _SseBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._gen.__anext__()
        except BaseException:
            # finished, failed or cancelled: nothing more will be read, release the requests now
            await self.aclose()
            raise

    def pause_producing(self) -> None:
        self._set_paused(True)

    def resume_producing(self) -> None:
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        """Hold (or release) the engine requests behind a response whose reader fell behind."""
        for stream in self._streams:
            self._engine.set_paused(stream.request_id, paused)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._gen.aclose()
        finally:
            await _close_all(self._streams)


async def _body_rest(head: list[bytes], rest: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in head:
        yield chunk
    for chunk in rest:  # each piece is built when the previous one is written
        yield chunk


def _json_body(obj: Any) -> Response | StreamResponse:
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


class OpenAIApp:
    """Routes requests to handlers; `server` (settable) supplies HTTP counters for /metrics."""

    def __init__(self, engine: EngineClient, served_model_name: str, api_key: str | None = None,
                 options: ApiOptions | None = None) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.options = options or ApiOptions()
        self._model_names = frozenset((served_model_name, *self.options.model_aliases))
        self._reasoning = ReasoningParser(engine.tokenizer) if self.options.reasoning_parser else None
        self.server: ResponseCounts | None = None
        self.draining = False  # set by begin_drain() on SIGTERM
        # Header values arrive as latin-1 text of the raw bytes: compare bytes with bytes.
        self._api_key = api_key.encode("utf-8") if api_key else None
        self._prompts = PromptPreparer(engine.tokenizer, engine.max_model_len)
        self._token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)
        # path -> (needs auth, {method: handler})
        self._routes: dict[str, tuple[bool, dict[str, Handler]]] = {
            "/v1/completions": (True, {"POST": self._completions}),
            "/v1/chat/completions": (True, {"POST": self._chat}),
            "/v1/models": (True, {"GET": self._models}),
            "/tokenize": (True, {"POST": self._tokenize}),
            "/detokenize": (True, {"POST": self._detokenize}),
            "/health": (False, {"GET": self._health}),
            "/load": (False, {"GET": self._load}),
            "/metrics": (False, {"GET": self._metrics}),
            "/version": (False, {"GET": self._version}),
        }

    def begin_drain(self) -> None:
        """Shutting down: /health answers 503 at once, so balancers stop sending here, and new
        generation requests get a 503 a router retries elsewhere, while in-flight ones finish."""
        self.draining = True

    async def handle(self, req: HttpRequest) -> Response | StreamResponse:
        try:
            return await self._dispatch(req)
        except HttpError as e:
            return Response(e.status, e.body(), headers=e.headers)
        except (ProtocolError, SamplingParamsError) as e:
            return Response(400, error_body(str(e), param=e.param))
        except Exception:
            log.exception("unhandled error for %s %s", req.method, req.path)
            return Response(500, error_body("internal server error", type="internal_server_error"))

    def precheck(self, req: HttpRequest) -> Response | None:
        """What a request's head alone decides (route, method, API key, content type): an error
        Response, or None when the body is worth receiving (before `100 Continue`)."""
        try:
            self._route(req)
        except HttpError as e:
            return Response(e.status, e.body(), headers=e.headers)
        return None

    async def _dispatch(self, req: HttpRequest) -> Response | StreamResponse:
        return await self._route(req)(req)

    def _route(self, req: HttpRequest) -> Handler:
        route = self._routes.get(req.path)
        if route is None:
            raise HttpError(404, f"no route for {preview(req.path)}", type="not_found_error",
                            code="not_found")
        needs_auth, methods = route
        if needs_auth:
            self._check_auth(req)
        # HEAD runs the GET handler: the server writes its head (Content-Length included), no body
        handler = methods.get("GET" if req.method == "HEAD" else req.method)
        if handler is None:
            allow = ", ".join([*methods, "HEAD"] if "GET" in methods else methods)
            raise HttpError(405, f"method {preview(req.method)} not allowed on {req.path}; use {allow}",
                            code="method_not_allowed", headers=[("allow", allow)])
        if req.method == "POST":
            self._check_content_type(req)
        return handler

    # --- request checks ---

    def _check_auth(self, req: HttpRequest) -> None:
        if self._api_key is None:
            return
        auth = req.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        token_bytes = token.strip(" \t").encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token_bytes, self._api_key):
            raise HttpError(401, "invalid or missing API key", type="authentication_error",
                            code="invalid_api_key", headers=[("www-authenticate", "Bearer")])

    @staticmethod
    def _check_content_type(req: HttpRequest) -> None:
        ctype = req.headers.get("content-type")
        if ctype is None:
            return
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise HttpError(415, f"content-type must be application/json, got {preview(ctype)}",
                            code="unsupported_media_type")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self._model_names:
            raise HttpError(404, f"the model {preview(model)} does not exist; this server serves "
                                 f"'{self.served_model_name}'", type="not_found_error",
                            param="model", code="model_not_found")

    def _check_token_ids(self, ids: tuple[int, ...] | list[int], param: str) -> None:
        # any id the model can produce is valid, also where its vocabulary has rows past the tokenizer
        model_config = getattr(self.engine, "model_config", None)  # optional: see EngineClient
        vocab = max(self.engine.tokenizer.vocab_size, model_config.vocab_size if model_config else 0)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ProtocolError(f"token id {bad[0]} is outside the vocabulary (size {vocab})", param)

    def _fit(self, prompts: list[list[int]], r: GenerationRequest, limits: AdmissionLimits,
             max_tokens_given: bool, prompt_param: str, max_tokens_param: str) -> list[int | None]:
        """Each prompt's max_tokens, checked against the context and the KV cache (a 400 naming
        the prompt or the max_tokens field); before the engine sees the request."""
        return [fit_context(len(p), r.params, limits, max_tokens_given=max_tokens_given,
                            prompt_param=prompt_param, max_tokens_param=max_tokens_param).max_tokens
                for p in prompts]

    def _truncate(self, ids: list[int], r: GenerationRequest) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the maximum context)."""
        k = r.truncate_prompt_tokens
        if k is None:
            return ids
        mml = self.engine.max_model_len
        if k > mml:
            raise ProtocolError(f"'truncate_prompt_tokens' ({k}) is greater than this model's maximum "
                                f"context length ({mml})", "truncate_prompt_tokens")
        return ids[-(mml if k == -1 else k):]

    # --- prompts ---

    async def _chat_prompt_ids(self, messages: tuple[dict[str, Any], ...] | list[dict[str, Any]],
                               opts: ChatTemplateOptions) -> list[int]:
        if opts.chat_template is not None and not self.options.trust_request_chat_template:
            raise ProtocolError("this server does not run chat templates sent in requests; start it with "
                                "--trust-request-chat-template to allow them", "chat_template")
        rendered = await self._prompts.render_chat(
            list(messages), add_generation_prompt=opts.add_generation_prompt,
            continue_final_message=opts.continue_final_message,
            tools=list(opts.tools) if opts.tools is not None else None,
            chat_template=opts.chat_template or self.options.chat_template, variables=opts.variables)
        if isinstance(rendered, str):
            # the template already wrote the special tokens (BOS, role markers)
            return await self._prompts.encode(rendered, "messages",
                                              add_special_tokens=opts.add_special_tokens)
        return list(rendered)

    def _with_defaults(self, r: RequestT, given: Container[str], logprobs_param: str) -> RequestT:
        """The parsed request with the model's sampling defaults (for the fields not `given`) and
        the server's logprobs cap."""
        try:
            params = self.options.sampling_defaults.apply(r.params, given.__contains__)
        except SamplingParamsError as e:
            raise ProtocolError(f"{e} (with the model's generation_config.json defaults)", e.param) from None
        cap = self.options.max_logprobs
        if params.logprobs is not None and params.logprobs > cap:
            raise ProtocolError(f"'{logprobs_param}' asks for {params.logprobs} logprobs; this server "
                                f"returns at most {cap} (--max-logprobs)", logprobs_param)
        return dataclasses.replace(r, params=params)

    async def _completion_prompt_ids(self, prompt: str | tuple[int, ...],
                                     add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            ids = await self._prompts.encode(prompt, "prompt", add_special_tokens=add_special_tokens)
        else:
            self._check_token_ids(prompt, "prompt")
            ids = list(prompt)
        if not ids:
            raise ProtocolError("the prompt encodes to no tokens", "prompt")
        return ids

    # --- generation plumbing ---

    def _start(self, ids: list[str], prompts: list[list[int]], r: GenerationRequest,
               max_tokens: list[int | None]) -> list[RequestStream]:
        """Add the n engine requests of each prompt (choice k: prompt k // n, sample k % n); on any
        failure abort the ones already added."""
        if self.draining:
            raise HttpError(503, "the server is shutting down; retry on another replica",
                            type="service_unavailable", headers=[("retry-after", "1")])
        streams: list[RequestStream] = []
        n = r.params.n
        per_prompt: list[SamplingParams] = [
            r.params if m == r.params.max_tokens else dataclasses.replace(r.params, max_tokens=m)
            for m in max_tokens]
        try:
            for k, rid in enumerate(ids):
                params = params_for_choice(per_prompt[k // n], k % n)
                streams.append(self.engine.add_request(rid, prompts[k // n], params, priority=r.priority))
        except Exception as e:
            for rid in ids[:len(streams)]:
                self.engine.abort(rid)
            mapped = _engine_error(e)
            if mapped is None:
                raise
            raise mapped from None
        return streams

    @staticmethod
    def _request_ids(base_id: str, count: int) -> list[str]:
        return [base_id] if count == 1 else [f"{base_id}-{i}" for i in range(count)]

    async def _collect(self, req: HttpRequest, streams: list[RequestStream], choices: list[_Choice]) -> None:
        """Drain all streams into `choices`; a client disconnect aborts them."""

        async def drain() -> None:
            async for i, out in _merge(streams):
                choices[i].update(out)

        work = asyncio.ensure_future(drain())
        gone = asyncio.ensure_future(req.disconnected.wait())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            await _close_all(streams)
        if not work.done() or work.cancelled():
            raise HttpError(499, "client closed the request", code="client_closed_request")
        work.result()
        failed = [c for c in choices if c.finish_reason == "error"]
        if failed:
            raise HttpError(500, failed[0].error or "the request failed in the engine",
                            type="internal_server_error")

    @staticmethod
    def _usage(num_prompt: int, choices: list[_Choice]) -> dict[str, int]:
        completion = sum(c.num_output_tokens for c in choices)
        return {"prompt_tokens": num_prompt, "completion_tokens": completion,
                "total_tokens": num_prompt + completion}

    # --- logprob shaping ---

    def _decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_name(self, as_ids: bool) -> Callable[[int], str]:
        """How logprobs name a token: its text, or "token_id:N" when the client asked for ids
        (return_tokens_as_token_ids: a token whose text is not valid UTF-8 alone stays distinct)."""
        return _token_id_name if as_ids else self._token_text

    def _completion_logprobs(self, lps: list[TokenLogprob], choice: _Choice, as_ids: bool,
                             lazy: bool = False) -> dict[str, Any]:
        """Completions logprobs; `lazy` leaves the top alternatives (the bulk) to be built as the
        body is written (a LazyList). text_offset counts characters of the generated text either
        way."""
        name = self._token_name(as_ids)
        tokens, token_lps, offsets = [], [], []
        for lp in lps:
            tokens.append(name(lp.token_id))
            token_lps.append(max(lp.logprob, LOGPROB_FLOOR))
            offsets.append(choice.text_offset)
            choice.text_offset += len(self._token_text(lp.token_id))

        def top(i: int) -> dict[str, float]:
            lp = lps[i]
            alts = {name(t): max(v, LOGPROB_FLOOR) for t, v in lp.top}
            alts.setdefault(tokens[i], max(lp.logprob, LOGPROB_FLOOR))  # the sampled token is always listed
            return alts

        tops = LazyList(len(lps), top)
        return {"tokens": tokens, "token_logprobs": token_lps,
                "top_logprobs": tops if lazy else tops.materialize(), "text_offset": offsets}

    def _chat_logprobs(self, lps: list[TokenLogprob], as_ids: bool, lazy: bool = False) -> dict[str, Any]:
        """Chat logprobs; `lazy` builds each token's entry as the body is written."""
        name = self._token_name(as_ids)

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = name(token_id)
            return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(text.encode())}

        def content(i: int) -> dict[str, Any]:
            lp = lps[i]
            e = entry(lp.token_id, lp.logprob)
            e["top_logprobs"] = [entry(t, v) for t, v in lp.top]
            return e

        entries = LazyList(len(lps), content)
        return {"content": entries if lazy else entries.materialize()}

    def _launch(self, prefix: str, prompts: list[list[int]], r: GenerationRequest,
                max_tokens: list[int | None]) -> tuple[str, int, list[RequestStream], list[_Choice]]:
        """Start the engine requests of one API call, n per prompt, choice index prompt * n + sample
        as OpenAI and vLLM number them, with each prompt's max_tokens from _fit: (response id,
        created, streams, choices)."""
        base_id = f"{prefix}-{uuid.uuid4().hex}"
        ids = self._request_ids(base_id, len(prompts) * r.params.n)
        streams = self._start(ids, prompts, r, max_tokens)
        if self.options.log_requests and log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: prompt tokens %s, priority %d, %s", base_id, [len(p) for p in prompts],
                      r.priority, r.params)
        choices = [_Choice(i, rid) for i, rid in enumerate(ids)]
        return base_id, int(time.time()), streams, choices

    # --- /v1/completions ---

    async def _completions(self, req: HttpRequest) -> Response | StreamResponse:
        body = parse_json_object(req.body)
        r = self._with_defaults(parse_completion_request(body, self.engine.max_model_len), fields_given(body),
                                "logprobs")
        self._check_model(r.model)
        limits = self.engine.limits
        # before the prompt work, which can be large
        check_params(r.params, limits, num_prompts=len(r.prompts))
        check_priority(r.priority, limits)
        field = parse_structured_fields(body)
        add_special = get_bool(body, "add_special_tokens", True)  # vLLM's field, default as there
        prompts = [self._truncate(await self._completion_prompt_ids(p, add_special), r) for p in r.prompts]
        max_tokens = self._fit(prompts, r, limits, body.get("max_tokens") is not None, "prompt", "max_tokens")
        r = dataclasses.replace(r, params=await constrain(self.engine, r.params, field))
        num_prompt = sum(map(len, prompts))
        base_id, created, streams, choices = self._launch("cmpl", prompts, r, max_tokens)
        if r.stream:
            return self._stream_response(
                streams, self._completion_events(base_id, created, r, num_prompt, choices))
        await self._collect(req, streams, choices)
        want_lp = r.params.logprobs is not None
        return _json_body({
            "id": base_id, "object": "text_completion", "created": created, "model": self.served_model_name,
            "choices": [{
                "index": c.index, "text": "".join(c.text),
                "logprobs": (self._completion_logprobs(c.logprobs, c, r.tokens_as_ids, lazy=True)
                             if want_lp else None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            } for c in choices],
            "usage": self._usage(num_prompt, choices),
        })

    def _completion_events(self, base_id: str, created: int, r: CompletionRequest, num_prompt: int,
                           choices: list[_Choice]) -> _Events:
        want_lp = r.params.logprobs is not None
        head = {"id": base_id, "object": "text_completion", "created": created,
                "model": self.served_model_name}

        def plain(index: int, text: str) -> dict[str, Any]:
            event = {**head, "choices": [{"index": index, "text": text, "logprobs": None,
                                          "finish_reason": None, "stop_reason": None}]}
            if r.include_usage:
                event["usage"] = None
            return event

        plain_event = _TextEvents(plain)

        def output(i: int, out: RequestOutput) -> list[bytes]:
            c = choices[i]
            c.update(out)
            if not out.finished and not want_lp and (out.text or out.token_ids):
                return [plain_event(i, out.text)]
            if out.finished and out.finish_reason == "error":
                return [_error_event(out), DONE]
            if _nothing_new(out):
                return []
            choice = {
                "index": i, "text": out.text,
                "logprobs": (self._completion_logprobs(list(out.logprobs or ()), c, r.tokens_as_ids)
                             if want_lp else None),
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None,
            }
            chunk = {**head, "choices": [choice]}
            if r.include_usage:
                chunk["usage"] = None
            return [_sse(chunk)]

        def last() -> list[bytes]:
            if not r.include_usage:
                return [DONE]
            return [_sse({**head, "choices": [], "usage": self._usage(num_prompt, choices)}), DONE]

        return _Events([], output, last)

    # --- /v1/chat/completions ---

    async def _chat(self, req: HttpRequest) -> Response | StreamResponse:
        chat = parse_chat_body(parse_json_object(req.body), self.options.enable_auto_tool_choice)
        r = self._with_defaults(chat.request, chat.given, "top_logprobs")
        self._check_model(r.model)
        limits = self.engine.limits
        check_params(r.params, limits)  # before the template and tokenizer run
        check_priority(r.priority, limits)
        prompt_ids = self._truncate(await self._chat_prompt_ids(r.messages, chat.template), r)
        if not prompt_ids:
            raise ProtocolError("the messages render to an empty prompt", "messages")
        max_tokens = self._fit([prompt_ids], r, limits, chat.max_tokens_given, "messages",
                               chat.max_tokens_param)
        reasoning = self._reasoning
        prompt_closed = reasoning is not None and reasoning.prompt_closed(prompt_ids)
        plan = ChatOutputPlan(reasoning, chat.tools, prompt_closed, chat.include_reasoning)
        r = dataclasses.replace(r, params=await constrain(self.engine, r.params, chat.constraint,
                                                          plan.grammar_start()))
        role, echoed = chat.reply_role, chat.echoed
        base_id, created, streams, choices = self._launch("chatcmpl", [prompt_ids], r, max_tokens)
        if r.stream:
            return self._stream_response(
                streams, self._chat_events(base_id, created, r, len(prompt_ids), choices, role, echoed, plan))
        await self._collect(req, streams, choices)
        replies = [plan.reply(role, "".join(c.text), echoed, c.finish_reason) for c in choices]
        return _json_body({
            "id": base_id, "object": "chat.completion", "created": created, "model": self.served_model_name,
            "choices": [{
                "index": c.index,
                "message": message,
                "logprobs": (self._chat_logprobs(c.logprobs, r.tokens_as_ids, lazy=True)
                             if r.want_logprobs else None),
                "finish_reason": finish_reason, "stop_reason": c.stop_reason,
            } for c, (message, finish_reason) in zip(choices, replies)],
            "usage": self._usage(len(prompt_ids), choices),
        })

    def _chat_events(self, base_id: str, created: int, r: ChatRequest, num_prompt: int,
                     choices: list[_Choice], role: str = "assistant", echoed: str = "",
                     plan: ChatOutputPlan | None = None) -> _Events:
        head = {"id": base_id, "object": "chat.completion.chunk", "created": created,
                "model": self.served_model_name}

        def chunk(choice: dict[str, Any]) -> bytes:
            body = {**head, "choices": [choice]}
            if r.include_usage:
                body["usage"] = None
            return _sse(body)

        plain_event = _TextEvents(lambda index, text: {**head, "choices": [{
            "index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None,
            "stop_reason": None}], **({"usage": None} if r.include_usage else {})})
        first = [chunk({"index": c.index, "delta": {"role": role, "content": ""},
                        "logprobs": None, "finish_reason": None}) for c in choices]
        if echoed:
            first += [chunk({"index": c.index, "delta": {"content": echoed}, "logprobs": None,
                             "finish_reason": None}) for c in choices]

        # reasoning and tool calls reshape each delta (chat_output); plain replies skip that
        shapers = [plan.shaper() for _ in choices] if plan is not None and plan.shapes else None

        def output(i: int, out: RequestOutput) -> list[bytes]:
            choices[i].update(out)
            if not out.finished and not r.want_logprobs and shapers is None and (out.text or out.token_ids):
                return [plain_event(i, out.text)]
            if out.finished and out.finish_reason == "error":
                return [_error_event(out), DONE]
            if _nothing_new(out):
                return []
            reason = out.finish_reason if out.finished else None
            if shapers is not None:
                delta = shapers[i].delta(out.text, out.finished)
                reason = shapers[i].finish_reason(reason, shapers[i].called)
            else:
                delta = {"content": out.text} if out.text or out.token_ids else {}
            return [chunk({
                "index": i, "delta": delta,
                "logprobs": (self._chat_logprobs(list(out.logprobs or ()), r.tokens_as_ids)
                             if r.want_logprobs else None),
                "finish_reason": reason,
                "stop_reason": out.stop_reason if out.finished else None,
            })]

        def last() -> list[bytes]:
            if not r.include_usage:
                return [DONE]
            return [_sse({**head, "choices": [], "usage": self._usage(num_prompt, choices)}), DONE]

        return _Events(first, output, last)

    def _stream_response(self, streams: list[RequestStream], events: _Events) -> StreamResponse:
        """One choice: the engine hands each output to a callback that writes its events into the
        response (no task wakes per token). Several choices are merged by a generator."""
        if len(streams) == 1:
            stream = streams[0]
            body = PushBody(on_abort=lambda: self.engine.abort(stream.request_id),
                            on_pause=lambda paused: self.engine.set_paused(stream.request_id, paused))
            for data in events.first:
                body.send(data)

            def deliver(out: RequestOutput) -> None:
                try:
                    datas = events.output(0, out)
                    for data in datas:
                        body.send(data)
                    if datas and datas[-1] is DONE:  # the engine failed the request
                        body.end()
                    elif out.finished:
                        for data in events.last():
                            body.send(data)
                        body.end()
                except Exception:
                    log.exception("writing a stream event failed")
                    body.end(ok=False)
                    self.engine.abort(stream.request_id)

            stream.deliver_to(deliver)
            return StreamResponse(200, body)
        return StreamResponse(200, _SseBody(_pull_events(streams, events), streams, self.engine))

    # --- small routes ---

    async def _models(self, req: HttpRequest) -> Response:
        name = self.served_model_name
        return _json({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "vt",
            "root": name, "parent": None, "max_model_len": self.engine.max_model_len,
        }]})

    async def _tokenize(self, req: HttpRequest) -> Response:
        body = parse_json_object(req.body)
        self._check_model(get_str(body, "model"))
        if body.get("messages") is not None:
            messages = parse_messages(body["messages"])
            ids = await self._chat_prompt_ids(messages, parse_template_options(body))
        elif body.get("prompt") is not None:
            prompt = get_str(body, "prompt")
            add_special = get_bool(body, "add_special_tokens", True)
            ids = await self._prompts.encode(prompt, "prompt", add_special_tokens=add_special)
        else:
            raise ProtocolError("either 'prompt' or 'messages' is required", "prompt")
        return _json_body({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len})

    async def _detokenize(self, req: HttpRequest) -> Response:
        body = parse_json_object(req.body)
        self._check_model(get_str(body, "model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise ProtocolError("'tokens' must be a list of integers", "tokens")
        mml = self.engine.max_model_len
        if len(tokens) > mml:  # no sequence of this model is longer; the work grows with the list
            raise ProtocolError(f"'tokens' has {len(tokens)} ids; this model's maximum context length "
                                f"is {mml} tokens", "tokens")

        def work() -> str:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise ProtocolError("'tokens' must be a list of integers", "tokens")
            self._check_token_ids(tokens, "tokens")
            return self.engine.tokenizer.decode(tokens, skip_special_tokens=False)

        return _json_body({"prompt": await self._prompts.run(work, len(tokens))})

    async def _health(self, req: HttpRequest) -> Response:
        if self.draining:
            return Response(503, error_body("the server is shutting down", type="service_unavailable"))
        problem = self.engine.health_problem
        if problem is None:
            return Response(200, b"")
        return Response(503, error_body(problem, type="service_unavailable"))

    async def _load(self, req: HttpRequest) -> Response:
        # vLLM's /load (--enable-server-load-tracking): requests the engine holds, waiting or running
        s = self.engine.stats()
        return _json({"server_load": s.num_requests_running + s.num_requests_waiting})

    async def _metrics(self, req: HttpRequest) -> Response:
        http = self.server.responses_total if self.server is not None else None
        text = metrics.render_metrics(self.engine.stats(), self.served_model_name, http)
        return Response(200, text.encode(), content_type=metrics.CONTENT_TYPE)

    async def _version(self, req: HttpRequest) -> Response:
        return _json({"version": _version()})


def _error_event(out: RequestOutput) -> bytes:
    """The SSE event that ends a stream whose request failed inside the engine."""
    return _sse({"error": {"message": out.error or "the request failed in the engine",
                           "type": "internal_server_error", "param": None, "code": None}})


def _nothing_new(out: RequestOutput) -> bool:
    """True for an output with no token, no text and no finish. A token with empty or held-back
    text still gets its chunk (as vLLM does): clients count tokens and time them from the stream."""
    return not out.text and not out.token_ids and not out.finished
