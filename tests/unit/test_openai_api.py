"""OpenAIApp against a scripted fake engine: validation, auth, routing, response and SSE shapes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
import pytest

from vt.config import EngineConfig
from vt.engine.admission import AdmissionLimits
from vt.engine.outputs import EngineDeadError, PromptTooLongError, QueueFullError, TokenLogprob
from vt.engine.stats import EngineStats
from vt.http.metrics import render_metrics
from vt.http.openai_api import OpenAIApp
from vt.http.server import HttpRequest, PushBody, Response, StreamResponse

MODEL = "tiny-model"


# --- fakes -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Out:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: str = "engine"


class CharTokenizer:
    """One token per byte; BOS = 1 when special tokens are added."""

    vocab_size = 256
    eos_token_ids = (2,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode())
        return [1, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if not (skip_special_tokens and i < 3)).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def token_to_id(self, token: str) -> int | None:
        return ord(token) if len(token) == 1 else None


class FakeStream:
    """Outputs by iteration, or handed to a callback (deliver_to), as the engine's streams do."""

    def __init__(self, request_id: str, outputs: list[Out], gate: asyncio.Event | None) -> None:
        self.request_id = request_id
        self._outputs = list(outputs)
        self._gate = gate
        self.done = False
        self.aborted = False
        self.closed = False
        self.pump: asyncio.Task | None = None

    def deliver_to(self, fn) -> None:
        async def pump() -> None:
            while not self.done and self._outputs:
                if self._gate is not None:
                    await self._gate.wait()
                await asyncio.sleep(0)
                if self.done:
                    return  # aborted meanwhile
                out = self._outputs.pop(0)
                self.done = out.finished
                fn(out)

        self.pump = asyncio.ensure_future(pump())

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Out:
        if self.done or not self._outputs:
            raise StopAsyncIteration
        if self._gate is not None:
            await self._gate.wait()
        await asyncio.sleep(0)
        out = self._outputs.pop(0)
        self.done = out.finished
        return out

    async def aclose(self) -> None:
        self.closed = True
        if not self.done:
            self.done = True
            self.aborted = True


@dataclass
class Call:
    request_id: str
    prompt: list[int]
    params: object
    priority: int


@dataclass
class FakeEngine:
    """Each request streams `pieces` one token each, then finishes with `finish`."""

    pieces: tuple[str, ...] = ("Hel", "lo", "", " world")
    finish: str = "length"
    stop_reason: str | int | None = None
    error: Exception | None = None
    fail_output: str | None = None
    gate: asyncio.Event | None = None
    healthy: bool = True
    max_model_len: int = 128
    max_waiting: int = 1024
    scheduling_policy: str = "priority"
    kv_blocks: int = 0  # KV cache blocks of 16 tokens; 0: unknown, not checked
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    calls: list[Call] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    paused: dict[str, bool] = field(default_factory=dict)
    grammars: list = field(default_factory=list)

    async def compile_grammar(self, spec):
        self.grammars.append(spec)

    def add_request(self, request_id, prompt_token_ids, params, priority=0):
        if self.error is not None:
            raise self.error
        self.calls.append(Call(request_id, list(prompt_token_ids), params, priority))
        outs = []
        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            tid = piece.encode()[0] if piece else 65
            lps = None
            if params.logprobs is not None:
                top = tuple((tid + j, -0.5 - j) for j in range(params.logprobs))
                lps = (TokenLogprob(tid, -0.5, top),)
            reason = ("error" if self.fail_output else self.finish) if last else None
            outs.append(Out(request_id, piece, (tid,), lps, last, reason,
                            self.stop_reason if last else None, len(prompt_token_ids), k + 1,
                            error=self.fail_output if last else None))
        stream = FakeStream(request_id, outs, self.gate)
        self.streams.append(stream)
        return stream

    @property
    def limits(self) -> AdmissionLimits:
        return AdmissionLimits(vocab_size=self.tokenizer.vocab_size, max_model_len=self.max_model_len,
                               max_waiting=self.max_waiting, max_banned=16, eos_token_ids=frozenset((2,)),
                               kv_tokens=self.kv_blocks * 16 or None,
                               priority_scheduling=self.scheduling_policy == "priority")

    @property
    def config(self) -> EngineConfig:
        return EngineConfig(model="fake", scheduling_policy=self.scheduling_policy)

    @property
    def health_problem(self) -> str | None:
        return None if self.healthy else "the engine stopped after an error: test"

    def set_paused(self, request_id, paused) -> None:
        self.paused[request_id] = paused

    def abort(self, request_id):
        self.aborted.append(request_id)
        for stream in self.streams:
            if stream.request_id == request_id and not stream.done:
                stream.done = stream.aborted = True

    def stats(self) -> EngineStats:
        s = EngineStats(num_requests_running=3, generation_tokens_total=42, block_size=16,
                        num_gpu_blocks=self.kv_blocks)
        s.request_success_total["stop"] += 5
        s.time_to_first_token_seconds.observe(0.003)
        return s


class FakeServer:
    responses_total = {200: 7, 404: 1}


def make_request(method: str, path: str, body=None, headers=None) -> HttpRequest:
    raw = body if isinstance(body, bytes) else (b"" if body is None else orjson.dumps(body))
    hdrs = {"content-type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    return HttpRequest(method=method, path=path, query="", headers=hdrs, body=raw,
                       client=("127.0.0.1", 5555), disconnected=asyncio.Event())


async def call(app: OpenAIApp, method: str, path: str, body=None, headers=None):
    return await app.handle(make_request(method, path, body, headers))


def jbody(resp: Response) -> dict:
    return orjson.loads(resp.body)


async def read_sse(resp: StreamResponse) -> list:
    """Parse a whole SSE body into JSON events; the final [DONE] sentinel becomes the string 'DONE'."""
    raw = b""
    if isinstance(resp.chunks, PushBody):
        parts: list[bytes] = []
        assert await resp.chunks.run(parts.append)
        raw = b"".join(parts)
    else:
        async for chunk in resp.chunks:
            raw += chunk
    assert raw.endswith(b"\n\n")
    events = []
    for frame in raw.split(b"\n\n")[:-1]:
        assert frame.startswith(b"data: "), frame
        data = frame[len(b"data: "):]
        events.append("DONE" if data == b"[DONE]" else orjson.loads(data))
    return events


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> OpenAIApp:
    return OpenAIApp(engine, MODEL)


COMPLETION = {"model": MODEL, "prompt": "hi there", "max_tokens": 8}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


# --- non-streaming shapes ----------------------------------------------------------------------

async def test_completion_response_shape(app, engine):
    resp = await call(app, "POST", "/v1/completions", COMPLETION)
    assert resp.status == 200
    body = jbody(resp)
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["text"] == "Hello world"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    prompt_len = len(CharTokenizer().encode("hi there"))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4,
                             "total_tokens": prompt_len + 4}
    assert engine.calls[0].prompt == CharTokenizer().encode("hi there")
    assert engine.calls[0].params.max_tokens == 8


async def test_completion_accepts_token_ids_and_single_string_list(app, engine):
    assert (await call(app, "POST", "/v1/completions", {"prompt": [5, 6, 7]})).status == 200
    assert engine.calls[-1].prompt == [5, 6, 7]
    assert (await call(app, "POST", "/v1/completions", {"prompt": ["ab"]})).status == 200
    assert engine.calls[-1].prompt == [1, 97, 98]


async def test_chat_response_shape_and_template(app, engine):
    resp = await call(app, "POST", "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 5, "stop": "x", "priority": 3})
    assert resp.status == 200
    body = jbody(resp)
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello world"}
    assert choice["finish_reason"] == "length"
    call_ = engine.calls[0]
    # text parts joined with "\n", as vLLM joins them for templates that take a string
    assert call_.prompt == list(b"<system>be brief\n<user>a\nb\n<assistant>")
    assert call_.params.max_tokens == 5
    assert call_.params.stop == ("x",)
    assert call_.priority == 3


async def test_stop_reason_is_reported(engine):
    engine.finish, engine.stop_reason = "stop", "\n\n"
    app = OpenAIApp(engine, MODEL)
    choice = jbody(await call(app, "POST", "/v1/completions", COMPLETION))["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "\n\n")


async def test_n2_fans_out_with_shifted_seeds(app, engine):
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "n": 2, "seed": 10})
    body = jbody(resp)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == len(CharTokenizer().encode("hi there"))
    ids = [c.request_id for c in engine.calls]
    assert ids == [f"{body['id']}-0", f"{body['id']}-1"]
    assert [c.params.seed for c in engine.calls] == [10, 11]
    assert all(c.params.n == 1 for c in engine.calls)


# --- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
    ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
    ("/v1/completions", {**COMPLETION, "stop": [1]}, "stop"),
    ("/v1/completions", {**COMPLETION, "logprobs": 6}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "seed": "x"}, "seed"),
    ("/v1/completions", {**COMPLETION, "priority": 1.5}, "priority"),
    ("/v1/completions", {**COMPLETION, "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": ["a"]}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", [1]]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1], []]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 999]}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages"),
    # asked-for behaviour vt does not have: a 400, never silently different output
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": [5]}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of"),
    ("/v1/completions", {**COMPLETION, "best_of": "3"}, "best_of"),
    ("/v1/completions", {**COMPLETION, "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {**COMPLETION, "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": "-100"}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [5, 99999999]}, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [5], "guided_regex": "a+"}, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": 3}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {**CHAT, "best_of": "x"}, "best_of"),
    *((path, {**base, **extra}, name) for path, base in (("/v1/completions", COMPLETION),
                                                         ("/v1/chat/completions", CHAT))
      for extra in ({"allowed_token_ids": []}, {"allowed_token_ids": "5"}, {"bad_words": ["the"]},
                    {"return_tokens_as_token_ids": 1}, {"truncate_prompt_tokens": 0},
                    {"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": "x"},
                    {"truncate_prompt_tokens": 129})
      for name in extra),
    # the context (128 tokens here): the field that does not fit is named
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": "x" * 127}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["ok", "x" * 127]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 120}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**31}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 127}]}, "messages"),
])
async def test_bad_params_give_400_with_param(app, engine, path, body, param):
    resp = await call(app, "POST", path, body)
    assert resp.status == 400, resp.body
    err = jbody(resp)["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    assert engine.calls == []


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"logit_bias": {}, "suffix": None, "best_of": 1, "use_beam_search": False}),
    ("/v1/completions", {"n": 2, "best_of": 2}),
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "logit_bias": None}),
    ("/v1/completions", {"logit_bias": {"5": 100, "7": -0.5}, "allowed_token_ids": [5, 9]}),
    ("/v1/chat/completions", {"logit_bias": {"5": -100}}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "none"}),
    ("/v1/chat/completions", {"tools": [], "tool_choice": "auto", "function_call": "none"}),
])
async def test_inert_forms_of_unsupported_fields_are_accepted(app, engine, path, extra):
    base = COMPLETION if path == "/v1/completions" else CHAT
    resp = await call(app, "POST", path, {**base, **extra})
    assert resp.status == 200, resp.body
    assert len(engine.calls) == extra.get("n", 1)


async def test_unknown_fields_and_null_are_ignored(app):
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "bogus": 1, "temperature": None,
                                                       "user": "u1"})
    assert resp.status == 200


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe{}", b""])
async def test_bad_json_gives_400(app, raw):
    resp = await app.handle(make_request("POST", "/v1/completions", raw))
    assert resp.status == 400
    assert jbody(resp)["error"]["message"]


async def test_wrong_model_is_404(app):
    resp = await call(app, "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-4"})
    assert resp.status == 404
    assert jbody(resp)["error"]["code"] == "model_not_found"


async def test_missing_model_is_accepted(app):
    resp = await call(app, "POST", "/v1/chat/completions", {"messages": CHAT["messages"]})
    assert resp.status == 200


# --- routing, content type, auth ---------------------------------------------------------------

async def test_unknown_path_is_404(app):
    resp = await call(app, "GET", "/v2/nothing")
    assert resp.status == 404
    assert "error" in jbody(resp)


async def test_wrong_method_is_405_with_allow(app):
    resp = await call(app, "GET", "/v1/completions")
    assert resp.status == 405
    assert ("allow", "POST") in [(k.lower(), v) for k, v in resp.headers]


@pytest.mark.parametrize("ctype,status", [("text/plain", 415), ("application/json; charset=utf-8", 200),
                                          ("Application/JSON", 200)])
async def test_content_type(app, ctype, status):
    resp = await call(app, "POST", "/v1/completions", COMPLETION, {"content-type": ctype})
    assert resp.status == status


async def test_missing_content_type_is_accepted(app):
    req = make_request("POST", "/v1/completions", COMPLETION)
    del req.headers["content-type"]
    assert (await app.handle(req)).status == 200


async def test_api_key(engine):
    app = OpenAIApp(engine, MODEL, api_key="sekrit")
    assert (await call(app, "POST", "/v1/completions", COMPLETION)).status == 401
    bad = await call(app, "POST", "/v1/completions", COMPLETION, {"authorization": "Bearer nope"})
    assert bad.status == 401
    assert jbody(bad)["error"]["code"] == "invalid_api_key"
    assert (await call(app, "GET", "/v1/models")).status == 401
    assert (await call(app, "POST", "/tokenize", {"prompt": "a"})).status == 401
    ok = await call(app, "POST", "/v1/completions", COMPLETION, {"authorization": "Bearer sekrit"})
    assert ok.status == 200
    for path in ("/health", "/metrics", "/version"):
        assert (await call(app, "GET", path)).status == 200


# --- engine errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("exc,status", [
    (PromptTooLongError("the prompt has 200 tokens; max_model_len is 128"), 400),
    (ValueError("token id 7 is outside the vocabulary"), 400),
    (QueueFullError("the waiting queue is full"), 503),
    (EngineDeadError("the engine stopped"), 503),
])
async def test_engine_errors_map_to_status(engine, exc, status):
    engine.error = exc
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/v1/completions", COMPLETION)
    assert resp.status == status
    assert jbody(resp)["error"]["message"] == str(exc)
    if isinstance(exc, QueueFullError):
        assert "retry-after" in [k.lower() for k, _ in resp.headers]


async def test_failed_request_is_500(engine):
    engine.fail_output = "device fell over"
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/v1/chat/completions", CHAT)
    assert resp.status == 500
    assert jbody(resp)["error"]["message"] == "device fell over"


async def test_failed_streaming_request_sends_error_event(engine):
    engine.fail_output = "device fell over"
    app = OpenAIApp(engine, MODEL)
    events = await read_sse(await call(app, "POST", "/v1/completions", {**COMPLETION, "stream": True}))
    assert events[-1] == "DONE"
    assert events[-2]["error"]["message"] == "device fell over"


# --- streaming ---------------------------------------------------------------------------------

async def test_completion_stream_framing(app):
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "stream": True})
    assert isinstance(resp, StreamResponse)
    assert resp.status == 200
    assert resp.content_type.startswith("text/event-stream")
    events = await read_sse(resp)
    assert events[-1] == "DONE"
    chunks = events[:-1]
    # one chunk per token, an empty text delta included; the texts concatenate to the full text
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo", "", " world"]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)


async def test_stream_include_usage(app):
    resp = await call(app, "POST", "/v1/completions", {
        **COMPLETION, "stream": True, "stream_options": {"include_usage": True}})
    events = await read_sse(resp)
    assert events[-1] == "DONE"
    final = events[-2]
    assert final["choices"] == []
    prompt_len = len(CharTokenizer().encode("hi there"))
    assert final["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4,
                              "total_tokens": prompt_len + 4}
    assert all(e["usage"] is None for e in events[:-2])


async def test_chat_stream_role_first_then_content(app):
    resp = await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    events = await read_sse(resp)
    assert events[-1] == "DONE"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[1:]]
    assert deltas == ["Hel", "lo", "", " world"]  # one chunk per token
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_final_chunk_without_text(engine):
    engine.pieces = ("a", "")
    engine.finish = "stop"
    app = OpenAIApp(engine, MODEL)
    events = await read_sse(await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True}))
    last = events[-2]["choices"][0]
    assert last["delta"].get("content", "") == ""  # no text in the last token
    assert last["finish_reason"] == "stop"


async def test_stream_n2_merges_choices(app, engine):
    resp = await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True, "n": 2,
                                                            "stream_options": {"include_usage": True}})
    events = await read_sse(resp)
    chunks = [e for e in events[:-1] if e["choices"]]
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes = []
    for c in chunks:
        ch = c["choices"][0]
        by_index[ch["index"]] += ch["delta"].get("content", "")
        if ch["finish_reason"]:
            finishes.append(ch["index"])
    assert by_index == {0: "Hello world", 1: "Hello world"}
    assert sorted(finishes) == [0, 1]
    # outputs of both choices interleave as they arrive rather than one choice after the other
    order = [c["choices"][0]["index"] for c in chunks[2:]]
    assert order[:2] == [0, 1]
    assert events[-2]["usage"]["completion_tokens"] == 8


async def test_stream_aclose_aborts_unfinished_requests(engine):
    engine.gate = asyncio.Event()
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True, "n": 2})
    it = resp.chunks.__aiter__()
    first = await it.__anext__()
    assert b"assistant" in first
    await resp.chunks.aclose()
    assert [s.aborted for s in engine.streams] == [True, True]


async def test_stream_closed_before_start_aborts(engine):
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "stream": True})
    await resp.chunks.aclose()
    assert [s.aborted for s in engine.streams] == [True]


async def test_finished_stream_is_not_aborted(app, engine):
    await read_sse(await call(app, "POST", "/v1/completions", {**COMPLETION, "stream": True}))
    assert [s.aborted for s in engine.streams] == [False]


async def test_disconnect_aborts_non_streaming_request(engine):
    engine.gate = asyncio.Event()
    app = OpenAIApp(engine, MODEL)
    req = make_request("POST", "/v1/completions", COMPLETION)
    task = asyncio.ensure_future(app.handle(req))
    await asyncio.sleep(0.01)
    assert not task.done()
    req.disconnected.set()
    resp = await asyncio.wait_for(task, 1)
    assert resp.status >= 400
    assert [s.aborted for s in engine.streams] == [True]


# --- logprobs ----------------------------------------------------------------------------------

async def test_completion_logprobs_shape(app):
    body = jbody(await call(app, "POST", "/v1/completions", {**COMPLETION, "logprobs": 2}))
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "l", "A", " "]
    assert lp["token_logprobs"] == [-0.5] * 4
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"][0] == {"H": -0.5, "I": -1.5}


async def test_completion_stream_logprobs_offsets_continue(app):
    events = await read_sse(await call(app, "POST", "/v1/completions",
                                       {**COMPLETION, "logprobs": 0, "stream": True}))
    offsets = [o for e in events[:-1] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]
    # with logprobs=0 the sampled token is still listed
    assert events[0]["choices"][0]["logprobs"]["top_logprobs"] == [{"H": -0.5}]


async def test_chat_logprobs_shape(app, engine):
    body = jbody(await call(app, "POST", "/v1/chat/completions",
                            {**CHAT, "logprobs": True, "top_logprobs": 3}))
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    first = content[0]
    assert first["token"] == "H" and first["logprob"] == -0.5 and first["bytes"] == [72]
    assert [t["token"] for t in first["top_logprobs"]] == ["H", "I", "J"]
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert engine.calls[0].params.logprobs == 3


async def test_logprobs_tokens_as_ids(app):
    # return_tokens_as_token_ids names every token by id; text offsets still count the text
    body = jbody(await call(app, "POST", "/v1/completions",
                            {**COMPLETION, "logprobs": 1, "return_tokens_as_token_ids": True}))
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{ord(c)}" for c in "HlA "]
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"][0] == {"token_id:72": -0.5}
    events = await read_sse(await call(app, "POST", "/v1/chat/completions",
                                       {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": True,
                                        "return_tokens_as_token_ids": True}))
    first = next(e["choices"][0]["logprobs"]["content"][0] for e in events
                 if e["choices"] and e["choices"][0].get("logprobs"))
    assert first["token"] == "token_id:72" and first["bytes"] == list(b"token_id:72")
    assert [t["token"] for t in first["top_logprobs"]] == ["token_id:72", "token_id:73"]


async def test_chat_without_logprobs_requests_none(app, engine):
    body = jbody(await call(app, "POST", "/v1/chat/completions", CHAT))
    assert body["choices"][0]["logprobs"] is None
    assert engine.calls[0].params.logprobs is None


# --- small routes ------------------------------------------------------------------------------

async def test_models(app):
    body = jbody(await call(app, "GET", "/v1/models"))
    assert body["object"] == "list"
    [m] = body["data"]
    assert (m["id"], m["object"], m["owned_by"], m["max_model_len"]) == (MODEL, "model", "vt", 128)


async def test_health(engine):
    app = OpenAIApp(engine, MODEL)
    assert (await call(app, "GET", "/health")).status == 200
    engine.healthy = False
    resp = await call(app, "GET", "/health")
    assert resp.status == 503 and "stopped after an error: test" in jbody(resp)["error"]["message"]


async def test_version(app):
    assert isinstance(jbody(await call(app, "GET", "/version"))["version"], str)


async def test_tokenize_and_detokenize(app):
    body = jbody(await call(app, "POST", "/tokenize", {"prompt": "ab"}))
    assert body == {"tokens": [1, 97, 98], "count": 3, "max_model_len": 128}
    body = jbody(await call(app, "POST", "/tokenize", {"prompt": "ab", "add_special_tokens": False}))
    assert body["tokens"] == [97, 98]
    body = jbody(await call(app, "POST", "/tokenize", {"messages": [{"role": "user", "content": "x"}]}))
    assert body["tokens"] == list(b"<user>x\n<assistant>")
    assert jbody(await call(app, "POST", "/detokenize", {"tokens": [97, 98]})) == {"prompt": "ab"}
    assert (await call(app, "POST", "/detokenize", {"tokens": "ab"})).status == 400
    assert (await call(app, "POST", "/detokenize", {"tokens": [100000]})).status == 400
    assert (await call(app, "POST", "/tokenize", {})).status == 400


class BoundedTokenizer(CharTokenizer):
    """CharTokenizer with a vocabulary to read: no token spells more than one character."""

    raw = type("Raw", (), {"normalizer": None,
                           "get_vocab": staticmethod(lambda with_added_tokens=True: {"a": 97})})()


async def test_tokenize_and_detokenize_are_bounded_by_the_context():
    engine = FakeEngine(tokenizer=BoundedTokenizer())  # 128 tokens: at most 128 characters fit
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/tokenize", {"prompt": "x" * 5000})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "prompt"
    assert "maximum context length is 128" in jbody(resp)["error"]["message"]
    resp = await call(app, "POST", "/tokenize", {"messages": [{"role": "user", "content": "x" * 5000}]})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "messages"
    resp = await call(app, "POST", "/detokenize", {"tokens": [97] * 129})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "tokens"
    assert jbody(await call(app, "POST", "/detokenize", {"tokens": [97] * 128})) == {"prompt": "a" * 128}
    assert jbody(await call(app, "POST", "/tokenize", {"prompt": "x" * 100}))["count"] == 101


async def test_metrics_route(engine):
    app = OpenAIApp(engine, MODEL)
    app.server = FakeServer()
    resp = await call(app, "GET", "/metrics")
    assert resp.status == 200
    assert resp.content_type.startswith("text/plain; version=0.0.4")
    text = resp.body.decode()
    assert f'vt:num_requests_running{{model_name="{MODEL}"}} 3' in text
    assert f'vt:generation_tokens_total{{model_name="{MODEL}"}} 42' in text
    assert 'vt:http_responses_total{status="200"} 7' in text


def test_render_metrics_histogram_and_labels():
    s = EngineStats()
    s.e2e_request_latency_seconds.observe(0.05)
    s.e2e_request_latency_seconds.observe(3.0)
    s.request_success_total["length"] += 2
    text = render_metrics(s, 'we"ird')
    lines = text.splitlines()
    label = 'model_name="we\\"ird"'
    assert f'vt:e2e_request_latency_seconds_bucket{{{label},le="0.04"}} 0' in lines
    assert f'vt:e2e_request_latency_seconds_bucket{{{label},le="0.06"}} 1' in lines
    assert f'vt:e2e_request_latency_seconds_bucket{{{label},le="+Inf"}} 2' in lines
    assert f'vt:e2e_request_latency_seconds_count{{{label}}} 2' in lines
    assert f'vt:e2e_request_latency_seconds_sum{{{label}}} 3.05' in lines
    assert f'vt:request_success_total{{{label},finished_reason="length"}} 2' in lines
    assert f'vt:request_success_total{{{label},finished_reason="stop"}} 0' in lines
    assert "# TYPE vt:time_to_first_token_seconds histogram" in lines
    assert "# TYPE vt:kv_cache_usage_perc gauge" in lines
    assert text.endswith("\n")


@pytest.mark.parametrize("text", ["", "Hel", ' "quoted" \\ back', "鱻🦀\u2028\x00\x1f\t\n",
                                  "\x00vt-text\x00"])
def test_plain_token_events_are_byte_for_byte_the_general_ones(text):
    from vt.http.sse import TextEvents as _TextEvents
    from vt.http.sse import sse_event as _sse

    def event(index, t):
        return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": MODEL,
                "choices": [{"index": index, "text": t, "logprobs": None, "finish_reason": None,
                             "stop_reason": None}], "usage": None}

    events = _TextEvents(event)
    for index in (0, 3, 0):
        assert events(index, text) == _sse(event(index, text))

    def odd(index, t):  # the marker in a field around the text
        return {**event(index, t), "model": "\x00vt-text\x00"}

    assert _TextEvents(odd)(0, text) == _sse(odd(0, text))


async def test_stream_tokens_carry_the_same_fields_with_and_without_usage(app):
    for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        for usage in (False, True):
            extra = {"stream_options": {"include_usage": True}} if usage else {}
            events = await read_sse(await call(app, "POST", route, {**body, "stream": True, **extra}))
            tokens = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"] is None
                      and "role" not in e["choices"][0].get("delta", {})]
            assert tokens, events
            for e in tokens:
                keys = ["id", "object", "created", "model", "choices"] + (["usage"] if usage else [])
                assert list(e) == keys
                assert e["choices"][0]["stop_reason"] is None and e["choices"][0]["logprobs"] is None


# --- hostile requests ----------------------------------------------------------------------------

async def test_non_ascii_api_key_is_compared_as_the_bytes_the_client_sends(engine):
    key = "clé-секрет"
    app = OpenAIApp(engine, MODEL, api_key=key)
    # the server hands header values over as latin-1 text of the raw bytes (UTF-8 here)
    sent = f"Bearer {key}".encode().decode("latin-1")
    assert (await call(app, "POST", "/v1/completions", COMPLETION, {"authorization": sent})).status == 200
    assert (await call(app, "POST", "/v1/completions", COMPLETION,
                       {"authorization": sent[:-1]})).status == 401


async def test_precheck_decides_on_the_head_alone(engine):
    app = OpenAIApp(engine, MODEL, api_key="k")
    head = make_request("POST", "/v1/completions", b"", {"authorization": "Bearer k"})
    assert app.precheck(head) is None
    assert app.precheck(make_request("POST", "/v1/completions", b"")).status == 401
    assert app.precheck(make_request("POST", "/nope", b"")).status == 404
    wrong_method = make_request("GET", "/v1/completions", None, {"authorization": "Bearer k"})
    assert app.precheck(wrong_method).status == 405


async def test_a_request_adding_more_sequences_than_the_queue_holds_is_400_not_503(engine):
    engine.max_waiting = 4
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c"], "n": 2})
    assert resp.status == 400, resp.body
    err = jbody(resp)["error"]
    assert err["param"] == "prompt" and "6 sequences" in err["message"] and "waiting queue" in err["message"]
    assert not engine.calls and not resp.headers  # no Retry-After: retrying cannot help
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "prompt": ["a", "b"], "n": 2})
    assert resp.status == 200 and len(engine.calls) == 4


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_priority_needs_priority_scheduling(engine, path, base):
    engine.scheduling_policy = "fcfs"
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", path, {**base, "priority": 7})
    assert resp.status == 400 and not engine.calls
    err = jbody(resp)["error"]
    assert err["param"] == "priority" and "priority scheduling is not enabled" in err["message"]
    assert (await call(app, "POST", path, {**base, "priority": 0})).status == 200
    assert (await call(app, "POST", path, base)).status == 200
    engine.scheduling_policy = "priority"
    resp = await call(OpenAIApp(engine, MODEL), "POST", path, {**base, "priority": 7})
    assert resp.status == 200 and engine.calls[-1].priority == 7


async def test_truncate_prompt_tokens_keeps_the_last_tokens(app, engine):
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "prompt": "abcdef",
                                                       "truncate_prompt_tokens": 3})
    assert resp.status == 200 and engine.calls[-1].prompt == list(b"def")
    assert jbody(resp)["usage"]["prompt_tokens"] == 3
    # token prompts longer than the context are cut, not refused
    long_ids = [5] * 300 + [7, 8]
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "prompt": long_ids,
                                                       "truncate_prompt_tokens": 10})
    assert resp.status == 200 and engine.calls[-1].prompt == [5] * 8 + [7, 8]
    resp = await call(app, "POST", "/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 4})
    assert resp.status == 200 and engine.calls[-1].prompt == list(b"ant>")
    # -1 keeps the maximum context, which leaves no room for output
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "prompt": long_ids,
                                                       "truncate_prompt_tokens": -1})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "prompt"


async def test_an_unasked_max_tokens_is_lowered_to_what_the_context_leaves(app, engine):
    # completions default to 16 tokens: a 120-token prompt leaves 8 of the 128
    resp = await call(app, "POST", "/v1/completions", {"prompt": "x" * 119})
    assert resp.status == 200 and engine.calls[-1].params.max_tokens == 8
    resp = await call(app, "POST", "/v1/completions", {"prompt": "x" * 119, "max_tokens": 9})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "max_tokens"
    assert "at most 8" in jbody(resp)["error"]["message"]


async def test_a_request_the_kv_cache_cannot_hold_names_its_field(engine):
    engine.kv_blocks = 4  # 64 tokens of KV cache for a 128-token context
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/v1/chat/completions", CHAT)  # max_tokens unset: up to 128
    err = jbody(resp)["error"]
    assert resp.status == 400 and err["param"] == "messages" and "KV cache" in err["message"]
    assert "chatcmpl" not in err["message"]
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "max_tokens": 100})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "max_tokens"
    assert not engine.calls
    assert (await call(app, "POST", "/v1/completions", {**COMPLETION, "max_tokens": 40})).status == 200


@pytest.mark.parametrize("raw,message", [(b"18446744073709551616", "out of range"),
                                         (b"-9223372036854775809", "out of range"),
                                         (b"2.5", "must be an integer")])
async def test_integers_beyond_64_bits_are_out_of_range(app, raw, message):
    body = b'{"prompt": "hi", "n": ' + raw + b"}"
    resp = await app.handle(make_request("POST", "/v1/completions", body))
    err = jbody(resp)["error"]
    assert resp.status == 400 and err["param"] == "n" and message in err["message"]


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", "/version", "/load"])
async def test_head_answers_as_get(app, path):
    get, head = await call(app, "GET", path), await call(app, "HEAD", path)
    assert head.status == get.status == 200
    assert head.content_type == get.content_type
    # the server writes the head only, with the Content-Length of this body
    assert len(head.body) == len(get.body) or path in ("/v1/models", "/metrics")


async def test_allow_lists_head_beside_get(app):
    resp = await call(app, "POST", "/v1/models", {})
    assert resp.status == 405 and ("allow", "GET, HEAD") in [(k.lower(), v) for k, v in resp.headers]
    resp = await call(app, "HEAD", "/v1/completions")
    assert resp.status == 405 and ("allow", "POST") in [(k.lower(), v) for k, v in resp.headers]


async def test_n_beyond_the_waiting_queue_is_400_not_503(engine):
    engine.max_waiting = 4
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "n": 5})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "n"
    assert not engine.calls
    assert (await call(app, "POST", "/v1/completions", {**COMPLETION, "n": 4})).status == 200


@pytest.mark.parametrize("field", ["prompt", "max_tokens", "temperature", "seed", "user", "stop",
                                   "model", "n"])
async def test_deep_nesting_is_400_with_a_short_message(app, field):
    deep = b"[" * 1000 + b"]" * 1000
    body = b'{"prompt": "x", "%s": %s}' % (field.encode(), deep) if field != "prompt" else \
        b'{"prompt": %s}' % deep
    resp = await call(app, "POST", "/v1/completions", body)
    err = jbody(resp)["error"]
    assert resp.status == 400 and err["param"] == field and len(err["message"]) < 300


async def test_large_non_streamed_answer_is_chunked_json_built_as_written(engine):
    engine.pieces = tuple(f"t{i}" for i in range(200))
    app = OpenAIApp(engine, MODEL)
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 16, "logprobs": True,
            "top_logprobs": 20}
    resp = await call(app, "POST", "/v1/chat/completions", body)
    assert isinstance(resp, StreamResponse) and resp.content_type == "application/json"
    chunks = [c async for c in resp.chunks]
    assert len(chunks) > 10 and max(len(c) for c in chunks) < 256 * 1024
    out = orjson.loads(b"".join(chunks))
    assert len(out["choices"]) == 16 and out["usage"]["completion_tokens"] == 16 * 200
    content = out["choices"][3]["logprobs"]["content"]
    assert len(content) == 200 and all(len(e["top_logprobs"]) == 20 for e in content)
    assert all(e["token"] == "t" and e["top_logprobs"][1]["token"] == "u" for e in content)
    # a small answer still goes out whole, with a Content-Length
    small = await call(app, "POST", "/v1/chat/completions", {**body, "n": 1, "logprobs": False,
                                                             "top_logprobs": None})
    assert isinstance(small, Response) and jbody(small)["choices"][0]["message"]["content"]


async def test_too_many_stop_strings_are_400_before_any_work(app, engine):
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "stop": ["s"] * 400_000})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "stop"
    assert not engine.calls
