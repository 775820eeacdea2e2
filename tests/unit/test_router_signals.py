"""What routers and endpoint pickers read from a replica: the vLLM-named metrics, /load, and a
/health that turns 503 as soon as the replica starts draining."""

from __future__ import annotations

import re

from tests.unit.test_openai_api import COMPLETION, MODEL, FakeEngine, call, jbody
from vt.engine.stats import EngineStats
from vt.http.metrics import render_metrics
from vt.http.openai_api import OpenAIApp

_SAMPLE = re.compile(r"^([a-zA-Z0-9_:]+)(\{[^}]*\})? (\S+)$")


def _samples(text: str) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        out.setdefault(m.group(1), []).append((m.group(2) or "", m.group(3)))
    return out


def _stats() -> EngineStats:
    s = EngineStats(num_requests_running=3, num_requests_waiting=5, kv_cache_usage_perc=0.25,
                    prompt_tokens_total=100, generation_tokens_total=42, num_preemptions_total=2,
                    prefix_cache_hit_tokens_total=64, prefix_cache_queries_total=96,
                    block_size=16, num_gpu_blocks=512)
    s.request_success_total["length"] += 4
    s.time_to_first_token_seconds.observe(0.02)
    s.inter_token_latency_seconds.observe(0.005)
    return s


def test_vllm_names_mirror_the_vt_ones() -> None:
    samples = _samples(render_metrics(_stats(), MODEL))
    label = f'{{model_name="{MODEL}"}}'
    # the gauges the model-server protocol names, under vLLM's current and older names
    for vllm, vt in [("vllm:num_requests_waiting", "vt:num_requests_waiting"),
                     ("vllm:num_requests_running", "vt:num_requests_running"),
                     ("vllm:kv_cache_usage_perc", "vt:kv_cache_usage_perc"),
                     ("vllm:gpu_cache_usage_perc", "vt:kv_cache_usage_perc"),
                     ("vllm:prompt_tokens_total", "vt:prompt_tokens_total"),
                     ("vllm:generation_tokens_total", "vt:generation_tokens_total"),
                     ("vllm:num_preemptions_total", "vt:num_preemptions_total"),
                     ("vllm:prefix_cache_hits_total", "vt:prefix_cache_hit_tokens_total"),
                     ("vllm:prefix_cache_queries_total", "vt:prefix_cache_queries_total")]:
        assert samples[vllm] == samples[vt] == [(label, samples[vt][0][1])], vllm
    assert samples["vllm:num_requests_waiting"][0][1] == "5"
    assert samples["vllm:kv_cache_usage_perc"][0][1] == "0.25"
    for vllm, vt in [("vllm:time_to_first_token_seconds", "vt:time_to_first_token_seconds"),
                     ("vllm:inter_token_latency_seconds", "vt:inter_token_latency_seconds"),
                     ("vllm:time_per_output_token_seconds", "vt:inter_token_latency_seconds"),
                     ("vllm:e2e_request_latency_seconds", "vt:e2e_request_latency_seconds")]:
        for suffix in ("_bucket", "_sum", "_count"):
            assert samples[vllm + suffix] == samples[vt + suffix], vllm + suffix
    assert samples["vllm:request_success_total"] == samples["vt:request_success_total"]
    [(labels, value)] = samples["vllm:cache_config_info"]
    assert 'block_size="16"' in labels and 'num_gpu_blocks="512"' in labels and value == "1"


def test_every_family_has_one_type_line() -> None:
    text = render_metrics(_stats(), MODEL)
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    for name in _samples(text):
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert family in types or name in types, name


async def test_load_counts_the_requests_the_engine_holds() -> None:
    engine = FakeEngine()
    engine.stats = _stats  # 3 running + 5 waiting
    body = jbody(await call(OpenAIApp(engine, MODEL), "GET", "/load"))
    assert body == {"server_load": 8}


async def test_draining_turns_health_and_new_requests_503_at_once() -> None:
    engine = FakeEngine()
    app = OpenAIApp(engine, MODEL)
    assert (await call(app, "GET", "/health")).status == 200
    app.begin_drain()
    health = await call(app, "GET", "/health")
    assert health.status == 503
    assert jbody(health)["error"]["type"] == "service_unavailable"
    resp = await call(app, "POST", "/v1/completions", COMPLETION)
    assert resp.status == 503
    assert ("retry-after", "1") in resp.headers
    assert engine.calls == []  # never reached the engine
    # what a balancer reads still works while draining
    assert (await call(app, "GET", "/metrics")).status == 200
    assert (await call(app, "GET", "/load")).status == 200


def test_router_retries_outlast_a_failed_health_check() -> None:
    """A draining replica answers 503 until the router's next health check drops it: the retry
    flags `vt replicas` gives the router wait longer than one check (interval and timeout), even
    with every backoff cut short by the router's jitter."""
    from vt.launch.replicas import HEALTH_CHECK_TIMEOUT_S, retry_args

    for interval in (1, 3, 10):
        args = dict(zip(retry_args(interval)[::2], retry_args(interval)[1::2]))
        factor, cap = float(args["--retry-backoff-multiplier"]), float(args["--retry-max-backoff-ms"])
        waits, wait = [], float(args["--retry-initial-backoff-ms"])
        for _ in range(int(args["--retry-max-retries"]) - 1):  # the first attempt counts
            waits.append(wait)
            wait = min(wait * factor, cap)
        shortest = sum(waits) * (1 - float(args["--retry-jitter-factor"]))
        assert shortest > (interval + HEALTH_CHECK_TIMEOUT_S) * 1000, (interval, args)
