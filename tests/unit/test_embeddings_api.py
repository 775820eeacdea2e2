"""POST /v1/embeddings in OpenAIApp against a scripted embedding engine: OpenAI's request and
response shapes, vLLM's extras, every bad input a 400 naming its field, and each runner's
server refusing the other runner's routes with a 404."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np
import orjson
import pytest

from tests.unit.test_openai_api import MODEL, CharTokenizer, FakeEngine, FakeStream, call, jbody
from vt.config import ModelConfig
from vt.engine.outputs import QueueFullError, RequestOutput
from vt.http.embeddings import encode_vector, parse_inputs
from vt.http.engine_client import EngineClient, PoolingClient
from vt.http.openai_api import OpenAIApp
from vt.http.protocol import ProtocolError
from vt.model.pooling import PoolingConfig, pooled_vector

HIDDEN = 8


@dataclass
class EmbedCall:
    request_id: str
    prompt: list[int]
    dimensions: int | None
    priority: int


@dataclass
class FakeEmbeddingEngine(FakeEngine):
    """Each prompt's vector is a function of its token ids; `fail` ends a request with an error."""

    pooling: PoolingConfig | None = field(default_factory=lambda: PoolingConfig(matryoshka=True))
    fail: str | None = None
    embed_calls: list[EmbedCall] = field(default_factory=list)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig("Qwen3ForCausalLM", self.tokenizer.vocab_size, HIDDEN, 16, 1, 2, 1, 4, 1e-6, 1e6,
                           None, self.max_model_len, False, False, True)

    def embed(self, request_id, prompt_token_ids, dimensions=None, priority=0, cache_salt=None):
        if self.error is not None:
            raise self.error
        self.embed_calls.append(EmbedCall(request_id, list(prompt_token_ids), dimensions, priority))
        out = RequestOutput(request_id, "", (), None, True, "error" if self.fail else "stop", None,
                            len(prompt_token_ids), 0, 0, self.fail,
                            embedding=None if self.fail else expected(prompt_token_ids, dimensions))
        stream = FakeStream(request_id, [out], None)
        self.streams.append(stream)
        return stream


def expected(ids: list[int], dimensions: int | None = None) -> np.ndarray:
    hidden = np.arange(1, HIDDEN + 1, dtype=np.float32) * (1 + sum(ids) % 7)
    return pooled_vector(hidden, True, dimensions)


EMBED = {"model": MODEL, "input": "hello"}


@pytest.fixture
def engine() -> FakeEmbeddingEngine:
    return FakeEmbeddingEngine()


@pytest.fixture
def app(engine: FakeEmbeddingEngine) -> OpenAIApp:
    return OpenAIApp(engine, MODEL)


def test_the_fake_meets_both_protocols(engine: FakeEmbeddingEngine) -> None:
    assert isinstance(engine, EngineClient) and isinstance(engine, PoolingClient)


async def test_response_shape_string_input(app: OpenAIApp, engine: FakeEmbeddingEngine) -> None:
    resp = await call(app, "POST", "/v1/embeddings", {**EMBED, "user": "someone"})
    assert resp.status == 200
    body = jbody(resp)
    assert body["id"].startswith("embd-") and body["object"] == "list" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    ids = CharTokenizer().encode("hello")
    assert body["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids), "completion_tokens": 0}
    [item] = body["data"]
    assert item["index"] == 0 and item["object"] == "embedding"
    # JSON numbers: each float32 value exactly
    np.testing.assert_array_equal(np.asarray(item["embedding"], np.float32), expected(ids))
    assert engine.embed_calls == [EmbedCall(body["id"], ids, None, 0)]


@pytest.mark.parametrize("value,prompts", [
    (["ab", "c", "def"], [[1, 97, 98], [1, 99], [1, 100, 101, 102]]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5], [6, 7], [8, 9, 10]], [[5], [6, 7], [8, 9, 10]]),
])
async def test_batches_and_token_ids_keep_their_order(app, engine, value, prompts) -> None:
    body = jbody(await call(app, "POST", "/v1/embeddings", {**EMBED, "input": value}))
    assert [d["index"] for d in body["data"]] == list(range(len(prompts)))
    for d, p in zip(body["data"], prompts, strict=True):
        np.testing.assert_array_equal(np.asarray(d["embedding"], np.float32), expected(p))
    assert [c.prompt for c in engine.embed_calls] == prompts
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    if len(prompts) > 1:  # one engine request per input, each its own id
        assert len({c.request_id for c in engine.embed_calls}) == len(prompts)


async def test_base64_is_little_endian_float32(app) -> None:
    body = jbody(await call(app, "POST", "/v1/embeddings",
                            {**EMBED, "input": [3, 4], "encoding_format": "base64"}))
    raw = base64.b64decode(body["data"][0]["embedding"])
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), expected([3, 4]))
    v = np.array([1.5, -2.25], np.float32)
    assert base64.b64decode(encode_vector(v, "base64")) == v.astype("<f4").tobytes()
    assert orjson.loads(orjson.dumps({"e": encode_vector(v, "float")})) == {"e": [1.5, -2.25]}


async def test_dimensions_and_extras_reach_the_engine(engine) -> None:
    engine.scheduling_policy = "priority"
    app = OpenAIApp(engine, MODEL)
    body = jbody(await call(app, "POST", "/v1/embeddings", {
        **EMBED, "input": "hello world", "dimensions": 4, "priority": -3, "add_special_tokens": False,
        "truncate_prompt_tokens": 5}))
    want = CharTokenizer().encode("hello world", add_special_tokens=False)[-5:]
    assert engine.embed_calls == [EmbedCall(body["id"], want, 4, -3)]
    assert len(body["data"][0]["embedding"]) == 4


@pytest.mark.parametrize("body,param,status", [
    ({"input": None}, "input", 400),
    ({}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": ""}, "input", 400),                       # no tokens (the fake adds no BOS below)
    ({"input": [1, "a"]}, "input", 400),
    ({"input": [[1, 2], "a"]}, "input", 400),
    ({"input": [[1, -2]]}, "input", 400),
    ({"input": [[]]}, "input", 400),
    ({"input": [300]}, "input", 400),                    # outside the vocabulary
    ({"input": "x" * 200}, "input", 400),                # past max_model_len 128
    ({"input": ["a"] * 2049}, "input", 400),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", 400),
    ({"input": "a", "dimensions": 0}, "dimensions", 400),
    ({"input": "a", "dimensions": "8"}, "dimensions", 400),
    ({"input": "a", "dimensions": 9}, "dimensions", 400),  # more than the model's 8
    ({"input": "a", "user": 5}, "user", 400),
    ({"input": "a", "priority": 1}, "priority", 400),    # fcfs
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", 400),
    ({"input": "a", "truncate_prompt_tokens": 500}, "truncate_prompt_tokens", 400),
    ({"input": "a", "model": "other"}, "model", 404),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", 400),
])
async def test_bad_inputs_are_named(engine, body, param, status) -> None:
    engine.scheduling_policy = "fcfs"
    app = OpenAIApp(engine, MODEL)
    resp = await call(app, "POST", "/v1/embeddings", {**body, "add_special_tokens": False})
    assert resp.status == status, jbody(resp)
    error = jbody(resp)["error"]
    assert error["param"] == param and error["message"]
    assert not engine.embed_calls


async def test_dimensions_of_a_model_without_matryoshka_is_a_400_as_vllm_says(engine) -> None:
    engine.pooling = PoolingConfig()
    resp = await call(OpenAIApp(engine, MODEL), "POST", "/v1/embeddings", {**EMBED, "dimensions": 4})
    assert resp.status == 400
    assert jbody(resp)["error"] == {
        "message": f'Model "{MODEL}" does not support matryoshka representation, changing output dimensions '
                   "will lead to poor results.", "type": "invalid_request_error", "param": "dimensions",
        "code": None}


async def test_engine_errors_abort_the_inputs_added(engine) -> None:
    engine.error = QueueFullError("the waiting queue is full")
    resp = await call(OpenAIApp(engine, MODEL), "POST", "/v1/embeddings", EMBED)
    assert resp.status == 503 and "retry-after" in [k for k, _ in resp.headers]
    engine.error = None
    engine.fail = "the engine step failed: boom"
    resp = await call(OpenAIApp(engine, MODEL), "POST", "/v1/embeddings", {**EMBED, "input": ["a", "b"]})
    assert resp.status == 500 and jbody(resp)["error"]["message"] == "the engine step failed: boom"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
async def test_an_embedding_server_refuses_generation(app, engine, path, body) -> None:
    resp = await call(app, "POST", path, {"model": MODEL, **body})
    assert resp.status == 404
    error = jbody(resp)["error"]
    assert error["type"] == "not_found_error" and "--runner pooling" in error["message"]
    assert "/v1/embeddings" in error["message"] and not engine.calls


async def test_a_generating_server_refuses_embeddings() -> None:
    engine = FakeEngine()
    resp = await call(OpenAIApp(engine, MODEL), "POST", "/v1/embeddings", EMBED)
    assert resp.status == 404
    assert "generative model" in jbody(resp)["error"]["message"]
    assert (await call(OpenAIApp(engine, MODEL), "POST", "/v1/completions",
                       {"model": MODEL, "prompt": "hi"})).status == 200
    # an engine that could embed but runs a generative model answers the same way
    generating = FakeEmbeddingEngine(pooling=None)
    assert (await call(OpenAIApp(generating, MODEL), "POST", "/v1/embeddings", EMBED)).status == 404


async def test_a_draining_server_refuses_new_embeddings(app) -> None:
    app.begin_drain()
    resp = await call(app, "POST", "/v1/embeddings", EMBED)
    assert resp.status == 503


def test_parse_inputs() -> None:
    assert parse_inputs("a") == ("a",)
    assert parse_inputs(["a", "b"]) == ("a", "b")
    assert parse_inputs([1, 2]) == ((1, 2),)
    assert parse_inputs([[1], [2, 3]]) == ((1,), (2, 3))
    for bad in (None, 3, [], [[1], [True]], [1.5], {"a": 1}):
        with pytest.raises(ProtocolError):
            parse_inputs(bad)
