"""`vt bench`'s saved results: vt's own JSON (--json: every figure and request record) and
vLLM's result file (--save-result), whose field names and file name are `vllm bench serve`'s.

vLLM's file holds what vt measures under vLLM's names: completed, failed, total_input_tokens,
request_throughput, output_throughput, mean/median/std/pNN_{ttft,tpot,itl,e2el}_ms for the
--percentile-metrics and --metric-percentiles asked for, and so on. Where vt differs: a figure
with no sample (every request failed) is null, where vLLM writes 0; max_output_tokens_per_s is
the most tokens in any 1 s window (vLLM counts whole seconds from the first send) and
max_concurrent_requests counts failed requests too (they held a slot); vLLM's ASR (rtfx),
client-queue and speculative-decoding figures are not measured and not written. The server's
step figures are added where its /metrics gives them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from vt.bench.config import BenchConfig
from vt.bench.stats import BenchSummary, LatencyStats, RequestRecord, percentile_word


@dataclass
class RunResult:
    """One benchmark run: its records, duration and summary, and the server it ran against."""

    label: str
    records: list[RequestRecord]
    duration_s: float
    summary: BenchSummary
    server: dict[str, Any] = field(default_factory=dict)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def config_json(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    d["burstiness"] = "inf" if math.isinf(cfg.burstiness) else cfg.burstiness
    return d


def run_json(r: RunResult) -> dict:
    return {"label": r.label, "server": r.server, "figures": r.summary.figures(),
            "summary": r.summary.to_dict(), "requests": [asdict(rec) for rec in r.records]}


# ---------------------------------------------------------------- vLLM's result file


def model_id(cfg: BenchConfig, served: str) -> str:
    """vLLM's model_id: --model as given, else the served model's name."""
    if cfg.model_hint:
        return cfg.model_hint
    return cfg.model_dir if cfg.base_url is None and cfg.model_dir else served


def result_path(cfg: BenchConfig, model: str, date: str) -> Path:
    """vLLM's default name, {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, or
    --result-filename; under --result-dir where given (made if missing)."""
    label = cfg.label or cfg.backend
    concurrency = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency is not None else ""
    base_model = model.split("/")[-1]
    name = cfg.result_filename or f"{label}-{cfg.request_rate}qps{concurrency}-{base_model}-{date}.json"
    if cfg.result_dir:
        Path(cfg.result_dir).mkdir(parents=True, exist_ok=True)
        return Path(cfg.result_dir) / name
    return Path(name)


def _latency_fields(name: str, st: LatencyStats, percentiles: tuple[float, ...]) -> dict[str, float | None]:
    out = {f"mean_{name}_ms": st.mean_ms, f"median_{name}_ms": st.median_ms, f"std_{name}_ms": st.std_ms}
    for q in percentiles:
        word = percentile_word(q)
        out[f"p{word}_{name}_ms"] = st.percentiles_ms.get(word)
    return out


def vllm_result(r: RunResult, cfg: BenchConfig, date: str) -> dict[str, Any]:
    """The run as vLLM's --save-result writes it (--save-detailed adds the per-request lists)."""
    s, ok = r.summary, [rec.success for rec in r.records]
    out: dict[str, Any] = {
        "date": date, "endpoint_type": cfg.backend, "backend": cfg.backend, "label": cfg.label,
        "model_id": model_id(cfg, r.server.get("model", "")), "tokenizer_id": cfg.tokenizer_dir,
        "num_prompts": cfg.num_prompts, **cfg.metadata,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": "inf" if math.isinf(cfg.burstiness) else cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "duration": s.duration_s, "completed": s.successful_requests, "failed": s.failed_requests,
        "total_input_tokens": s.total_input_tokens, "total_output_tokens": s.total_output_tokens,
        "request_throughput": s.request_throughput, "request_goodput": s.goodput,
        "output_throughput": s.output_throughput, "total_token_throughput": s.total_token_throughput,
        # as vLLM: every request's latency in s, 0 for a failed one
        "latencies": [rec.latency if good else 0.0 for rec, good in zip(r.records, ok)],
        "max_output_tokens_per_s": s.peak_output_throughput,
        "max_concurrent_requests": s.peak_concurrent_requests,
    }
    if cfg.save_detailed:
        out |= {"input_lens": [rec.input_tokens for rec in r.records],
                "output_lens": [rec.output_tokens if good else 0 for rec, good in zip(r.records, ok)],
                "ttfts": [(rec.ttft or 0.0) if good else 0.0 for rec, good in zip(r.records, ok)],
                "itls": [rec.itls() if good else [] for rec, good in zip(r.records, ok)],
                "start_times": [rec.start for rec in r.records],
                "generated_texts": [rec.text for rec in r.records],
                "errors": [rec.error for rec in r.records]}
    if s.gpu is not None:
        steps = (("engine_steps", s.gpu.steps), ("mean_step_time_ms", s.gpu.mean_step_time_ms),
                 ("gpu_idle_fraction", s.gpu.gpu_idle_fraction))
        out |= {k: v for k, v in steps if v is not None}  # only what the server measured
    for name in cfg.percentile_metrics:
        out |= _latency_fields(name, getattr(s, name), cfg.metric_percentiles)
    return out


def save_vllm_result(r: RunResult, cfg: BenchConfig, now: datetime | None = None) -> Path:
    date = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    path = result_path(cfg, model_id(cfg, r.server.get("model", "")), date)
    write_json(path, vllm_result(r, cfg, date))
    return path
