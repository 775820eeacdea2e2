"""Prometheus text exposition (format 0.0.4) of engine stats and HTTP response counters."""

from __future__ import annotations

import math
from collections.abc import Mapping

from vt.engine.stats import EngineStats, Histogram
from vt.http.vllm_metrics import write_vllm_metrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")

_GAUGES = (
    ("num_requests_running", "Number of requests in the running batch."),
    ("num_requests_waiting", "Number of requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)."),
)
_COUNTERS = (
    ("prompt_tokens_total", "Prompt tokens processed."),
    ("generation_tokens_total", "Tokens generated."),
    ("num_preemptions_total", "Requests preempted."),
    ("prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache."),
    ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    ("steps_total", "Engine steps run."),
    ("step_time_seconds_total", "Time from step launch to completion, summed."),
    ("gpu_idle_seconds_total", "Time with work waiting but no step in flight."),
)
_HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time to first token."),
    ("inter_token_latency_seconds", "Time between consecutive output tokens."),
    ("e2e_request_latency_seconds", "End-to-end request latency."),
    ("request_queue_time_seconds", "Time a request waited from arrival to its first step."),
    ("request_prefill_time_seconds", "Time from a request's first step to its first token."),
    ("request_decode_time_seconds", "Time from a request's first token to its last."),
    ("request_inference_time_seconds", "Time from a request's first step to its last token."),
    ("request_prompt_tokens", "Prompt tokens of each finished request."),
    ("request_generation_tokens", "Generated tokens of each finished request."),
    ("iteration_tokens_total", "Tokens computed in each engine step."),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in pairs.items()) + "}"


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def header(self, name: str, kind: str, help_: str) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {_num(value)}")

    def histogram(self, name: str, labels: Mapping[str, str], h: Histogram) -> None:
        for bound, count in h.cumulative():
            self.sample(f"{name}_bucket", {**labels, "le": _num(float(bound))}, count)
        self.sample(f"{name}_sum", labels, float(h.total))
        self.sample(f"{name}_count", labels, h.count)


def _finish_reasons(stats: EngineStats) -> list[str]:
    return list(FINISH_REASONS) + sorted(str(reason) for reason in stats.request_success_total
                                         if reason not in FINISH_REASONS)


def render_metrics(stats: EngineStats, model_name: str,
                   http_responses: Mapping[int | str, int] | None = None) -> str:
    """The /metrics page: every engine metric labelled with model_name, then HTTP responses by
    status, then the vLLM-named mirror (vt.http.vllm_metrics)."""
    w = _Writer()
    base = {"model_name": model_name}
    for name, help_ in _GAUGES:
        w.header(f"vt:{name}", "gauge", help_)
        w.sample(f"vt:{name}", base, getattr(stats, name))
    for name, help_ in _COUNTERS:
        w.header(f"vt:{name}", "counter", help_)
        w.sample(f"vt:{name}", base, getattr(stats, name))

    w.header("vt:request_success_total", "counter", "Finished requests by finish reason.")
    for reason in _finish_reasons(stats):
        w.sample("vt:request_success_total", {**base, "finished_reason": reason},
                 stats.request_success_total.get(reason, 0))

    for name, help_ in _HISTOGRAMS:
        w.header(f"vt:{name}", "histogram", help_)
        w.histogram(f"vt:{name}", base, getattr(stats, name))

    w.header("vt:http_responses_total", "counter", "HTTP responses sent, by status code.")
    for status, count in sorted((http_responses or {}).items(), key=lambda kv: str(kv[0])):
        w.sample("vt:http_responses_total", {"status": str(status)}, count)
    write_vllm_metrics(w, stats, base, _finish_reasons)
    return "\n".join(w.lines) + "\n"
