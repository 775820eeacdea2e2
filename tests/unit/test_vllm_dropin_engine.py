"""What the engine side does for vLLM's request fields and metrics: cache_salt keeps prefix-cache
hits among requests of one salt (block pool, scheduler, engine), the detokenizer's
spaces_between_special_tokens, the request histograms vLLM's dashboard reads (with its
buckets), the access log, and the start-up time counted from the process's start."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import pytest

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.engine.stats import (
    ITERATION_TOKEN_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    EngineStats,
    token_count_buckets,
)
from vt.http.metrics import render_metrics
from vt.http.server import HttpLimits, HttpRequest, HttpServer, Response
from vt.launch.startup_log import seconds_since_process_start
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams
from vt.sched.kv_cache import BlockPool, hash_block
from vt.sched.request import Request, RequestStatus
from vt.sched.scheduler import Scheduler, SchedulerConfig
from vt.text.tokenizer import DetokStream, Tokenizer

BS = 4
IMPORTED_AT = time.monotonic()


# --- cache_salt in the block pool and the scheduler ---------------------------------------------

def _cache(pool: BlockPool, tokens: list[int], salt: str | None) -> None:
    blocks = pool.allocate(len(tokens) // BS)
    parent = None
    for i, b in enumerate(blocks):
        parent = pool.register_full(b, parent, tokens[i * BS:(i + 1) * BS], salt)
    pool.free(blocks)


def test_a_salted_prefix_is_found_only_under_its_salt():
    pool = BlockPool(16, BS)
    tokens = list(range(1, 9))  # two full blocks
    _cache(pool, tokens, "a")
    assert pool.peek_prefix(tokens, "a")[0] == 8
    assert pool.peek_prefix(tokens, "b")[0] == 0
    assert pool.peek_prefix(tokens)[0] == 0  # an unsalted request shares nothing with a salted one
    _cache(pool, tokens, None)
    assert pool.peek_prefix(tokens)[0] == 8 and pool.peek_prefix(tokens, "a")[0] == 8
    pool.check_invariants()
    # unsalted hashes are those vt always computed (KV events subscribers rebuild them)
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2], None) != hash_block(None, [1, 2], "a")
    assert hash_block(7, [1, 2], "a") == hash_block(7, [1, 2])  # only the first block is salted


def _request(rid: str, tokens: list[int], salt: str | None, arrival: float) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams(), arrival=arrival,
                   max_tokens=4, cache_salt=salt)


@pytest.mark.parametrize("salt, other, hit", [("a", "a", 8), ("a", "b", 0), ("a", None, 0), (None, None, 8)])
def test_the_scheduler_shares_cached_blocks_only_within_a_salt(salt, other, hit):
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=BS, num_blocks=32))
    prompt = list(range(1, 11))
    s.add(_request("first", prompt, salt, 0.0))
    s.schedule()
    s.append_token("first", 3)
    s.finish("first", RequestStatus.FINISHED_STOPPED)
    s.add(_request("second", prompt, other, 1.0))
    (seq,) = s.schedule().seqs
    assert seq.start_pos == hit and s.get("second").num_cached_tokens == hit
    s.check_invariants()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("dropin") / "tiny")


async def _run(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams,
               salt: str | None = None) -> list:
    return [out async for out in engine.add_request(rid, prompt, params, cache_salt=salt)]


async def test_the_engine_carries_the_salt_to_the_prefix_cache(model_dir):
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", max_model_len=256,
                                      num_gpu_blocks=64, block_size=BS))
    await engine.start()
    try:
        prompt = list(range(5, 5 + 3 * BS + 1))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        cached = []
        for i, salt in enumerate(["tenant-a", "tenant-a", "tenant-b", None]):
            outs = await _run(engine, f"r{i}", prompt, params, salt)
            cached.append(outs[-1].num_cached_tokens)
        assert cached == [0, 3 * BS, 0, 0]
    finally:
        await engine.stop()


# --- request histograms --------------------------------------------------------------------------

async def test_finished_requests_fill_vllms_histograms(model_dir):
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", max_model_len=200,
                                      num_gpu_blocks=64))
    await engine.start()
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        prompts = [[7 + i] * (10 + i) for i in range(3)]  # distinct: no prefix-cache hits
        await asyncio.gather(*(_run(engine, f"h{i}", p, params) for i, p in enumerate(prompts)))
        stats = engine.stats()
    finally:
        await engine.stop()
    assert stats.request_prompt_tokens.count == 3 and stats.request_prompt_tokens.total == 10 + 11 + 12
    assert stats.request_generation_tokens.total == 15
    assert stats.request_prompt_tokens.buckets == (1, 2, 5, 10, 20, 50, 100, 200)  # up to max_model_len
    for name in ("queue", "prefill", "decode", "inference"):
        h = getattr(stats, f"request_{name}_time_seconds")
        assert h.count == 3 and h.buckets == REQUEST_LATENCY_BUCKETS, name
    inference, parts = stats.request_inference_time_seconds.total, (
        stats.request_prefill_time_seconds.total + stats.request_decode_time_seconds.total)
    assert inference == pytest.approx(parts)
    # every step's tokens: each prompt once, then the 4 decodes that feed a sampled token back
    assert stats.iteration_tokens_total.total == sum(map(len, prompts)) + 3 * 4
    assert stats.iteration_tokens_total.count == stats.steps_total


def test_a_request_that_never_ran_has_no_phases():
    stats = EngineStats(max_model_len=100)
    stats.observe_finished(7, 0, 1.0, None, None, None)   # aborted while waiting
    stats.observe_finished(7, 0, 1.0, 1.5, None, None)    # aborted before its first token
    assert (stats.request_prompt_tokens.count, stats.request_queue_time_seconds.count) == (2, 1)
    assert stats.request_queue_time_seconds.total == 0.5 and stats.request_prefill_time_seconds.count == 0


def test_metrics_render_the_families_with_vllms_buckets():
    # vLLM's lists (vllm/v1/metrics/loggers.py), which its dashboard's panels are drawn over
    assert REQUEST_LATENCY_BUCKETS == (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                       50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
    assert ITERATION_TOKEN_BUCKETS == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    assert token_count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    stats = EngineStats(max_model_len=4096)
    stats.observe_finished(300, 20, 0.0, 0.4, 1.0, 3.0)
    stats.iteration_tokens_total.observe(300)
    text = render_metrics(stats, "m")
    for prefix in ("vllm:", "vt:"):
        assert f'{prefix}request_queue_time_seconds_bucket{{model_name="m",le="0.5"}} 1' in text
        assert f'{prefix}request_prefill_time_seconds_bucket{{model_name="m",le="0.5"}} 0' in text
        assert f'{prefix}request_prefill_time_seconds_bucket{{model_name="m",le="0.8"}} 1' in text
        assert f'{prefix}request_decode_time_seconds_sum{{model_name="m"}} 2.0' in text
        assert f'{prefix}request_prompt_tokens_bucket{{model_name="m",le="500.0"}} 1' in text
        assert f'{prefix}request_generation_tokens_bucket{{model_name="m",le="20.0"}} 1' in text
        assert f'{prefix}iteration_tokens_total_bucket{{model_name="m",le="256.0"}} 0' in text
        assert f'{prefix}iteration_tokens_total_bucket{{model_name="m",le="512.0"}} 1' in text
    assert "# TYPE vllm:request_inference_time_seconds histogram" in text
    assert 'vllm:request_decode_time_seconds_bucket{model_name="m",le="7680.0"} 1' in text
    assert 'vllm:iteration_tokens_total_bucket{model_name="m",le="16384.0"} 1' in text
    assert 'vllm:request_prompt_tokens_bucket{model_name="m",le="2000.0"}' in text
    assert 'vllm:request_prompt_tokens_bucket{model_name="m",le="5000.0"}' not in text


# --- spaces_between_special_tokens --------------------------------------------------------------------

def test_spaces_between_special_tokens_false_glues_added_tokens_that_follow_one_another(tmp_path):
    model = make_model(tmp_path / "m")
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": False}  # a space before each token
    (model / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_dir(model)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    word = tok.encode("hello", add_special_tokens=False)[0]
    ids = [start, end, start, word, end]

    def text(**options) -> str:
        detok = DetokStream(tok, [word, word], **options)
        return "".join(detok.push(i) for i in ids) + detok.flush()

    spaced = text(skip_special_tokens=False)
    assert spaced.split() == ["<|im_start|>", "<|im_end|>", "<|im_start|>", tok.decode([word]).strip(),
                              "<|im_end|>"]
    glued = text(skip_special_tokens=False, spaces_between_special_tokens=False)
    # as vLLM: an added token after an added token is its own text; one after a word keeps its space
    assert glued == spaced.replace("<|im_start|> <|im_end|>", "<|im_start|><|im_end|>") \
        .replace("<|im_end|> <|im_start|>", "<|im_end|><|im_start|>")
    assert glued != spaced and glued.endswith(" <|im_end|>")
    # with special tokens skipped the option changes nothing
    assert text(spaces_between_special_tokens=False) == text()


# --- the access log ------------------------------------------------------------------------------

async def _ok(request: HttpRequest) -> Response:
    return Response(200 if request.path == "/ok" else 404, b"{}")


@pytest.mark.parametrize("access_log", [True, False])
async def test_each_answered_request_gets_an_access_log_line(caplog, access_log):
    server = HttpServer(_ok, HttpLimits(), access_log=access_log)
    await server.start("127.0.0.1", 0)
    try:
        with caplog.at_level(logging.INFO, logger="vt.access"):
            async with httpx.AsyncClient() as client:
                await client.get(f"http://127.0.0.1:{server.port}/ok?a=1")
                await client.post(f"http://127.0.0.1:{server.port}/missing", content=b"x")
    finally:
        await server.close(1.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "vt.access"]
    if not access_log:
        assert lines == []
        return
    assert len(lines) == 2
    assert lines[0].startswith("127.0.0.1:") and lines[0].endswith(' - "GET /ok?a=1 HTTP/1.1" 200 OK')
    assert lines[1].endswith(' - "POST /missing HTTP/1.1" 404 Not Found')


# --- start-up time ------------------------------------------------------------------------------------

def test_the_process_age_counts_from_the_process_start():
    age = seconds_since_process_start()
    assert age is not None
    # the process began before this module was imported (after pytest, numpy and vt were)
    assert age >= time.monotonic() - IMPORTED_AT and age > 0.2
