"""The model-server-protocol metrics under vLLM's names, so routers and endpoint pickers set up for
vLLM (the vLLM and SGLang routers, the Gateway API Inference Extension, llm-d) read vt unchanged.

Each family mirrors a `vt:` one from the same EngineStats; only the names differ. The request
histograms (queue, prefill, decode, inference time; prompt and generated tokens; tokens per
step) keep vLLM's buckets, so its Grafana dashboard reads them unchanged. Where pickers
still default to an older vLLM name (`gpu_cache_usage_perc`, `time_per_output_token_seconds`),
both names are written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from vt.engine.stats import EngineStats, Histogram

# (EngineStats field, vLLM names, help)
GAUGES = (
    ("num_requests_running", ("vllm:num_requests_running",), "Number of requests in the running batch."),
    ("num_requests_waiting", ("vllm:num_requests_waiting",), "Number of requests waiting to be scheduled."),
    ("kv_cache_usage_perc", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
     "Fraction of KV cache blocks in use (0 to 1)."),
)
COUNTERS = (
    ("prompt_tokens_total", ("vllm:prompt_tokens_total",), "Prompt tokens processed."),
    ("generation_tokens_total", ("vllm:generation_tokens_total",), "Tokens generated."),
    ("num_preemptions_total", ("vllm:num_preemptions_total",), "Requests preempted."),
    ("prefix_cache_hit_tokens_total", ("vllm:prefix_cache_hits_total",),
     "Prompt tokens served from the prefix cache."),
    ("prefix_cache_queries_total", ("vllm:prefix_cache_queries_total",),
     "Prompt tokens looked up in the prefix cache."),
)
HISTOGRAMS = (
    ("time_to_first_token_seconds", ("vllm:time_to_first_token_seconds",), "Time to first token."),
    ("inter_token_latency_seconds", ("vllm:inter_token_latency_seconds",
                                     "vllm:time_per_output_token_seconds"),
     "Time between consecutive output tokens."),
    ("e2e_request_latency_seconds", ("vllm:e2e_request_latency_seconds",), "End-to-end request latency."),
    # the families vLLM's Grafana dashboard reads beside those, with vLLM's buckets
    ("request_queue_time_seconds", ("vllm:request_queue_time_seconds",),
     "Histogram of time spent in WAITING phase for request."),
    ("request_prefill_time_seconds", ("vllm:request_prefill_time_seconds",),
     "Histogram of time spent in PREFILL phase for request."),
    ("request_decode_time_seconds", ("vllm:request_decode_time_seconds",),
     "Histogram of time spent in DECODE phase for request."),
    ("request_inference_time_seconds", ("vllm:request_inference_time_seconds",),
     "Histogram of time spent in RUNNING phase for request."),
    ("request_prompt_tokens", ("vllm:request_prompt_tokens",), "Number of prefill tokens processed."),
    ("request_generation_tokens", ("vllm:request_generation_tokens",),
     "Number of generation tokens processed."),
    ("iteration_tokens_total", ("vllm:iteration_tokens_total",),
     "Histogram of number of tokens per engine_step."),
)


class Writer(Protocol):
    def header(self, name: str, kind: str, help_: str) -> None: ...
    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None: ...
    def histogram(self, name: str, labels: Mapping[str, str], h: Histogram) -> None: ...


def write_vllm_metrics(w: Writer, stats: EngineStats, base: Mapping[str, str],
                       finish_reasons: Callable[[EngineStats], list[str]]) -> None:
    """Append the vLLM-named families to w; `base` holds the model_name label."""
    for kind, table in (("gauge", GAUGES), ("counter", COUNTERS)):
        for field, names, help_ in table:
            for name in names:
                w.header(name, kind, help_)
                w.sample(name, base, getattr(stats, field))
    for field, names, help_ in HISTOGRAMS:
        for name in names:
            w.header(name, "histogram", help_)
            w.histogram(name, base, getattr(stats, field))
    w.header("vllm:request_success_total", "counter", "Finished requests by finish reason.")
    for reason in finish_reasons(stats):
        w.sample("vllm:request_success_total", {**base, "finished_reason": reason},
                 stats.request_success_total.get(reason, 0))
    # The prefix-cache scorers read the block size from here; vt serves no LoRA adapters.
    w.header("vllm:cache_config_info", "gauge", "KV cache configuration, in labels.")
    w.sample("vllm:cache_config_info", {
        "block_size": str(stats.block_size), "num_gpu_blocks": str(stats.num_gpu_blocks),
        "enable_prefix_caching": str(stats.enable_prefix_caching)}, 1)
    w.header("vllm:lora_requests_info", "gauge", "LoRA adapters running and waiting (none in vt).")
    w.sample("vllm:lora_requests_info", {"max_lora": "0", "running_lora_adapters": "",
                                         "waiting_lora_adapters": ""}, 0)
