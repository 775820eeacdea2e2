"""The validated options of one `vt bench` run, and the vLLM names it answers to.

`vt bench` takes `vllm bench serve`'s flags beside its own; the tables here say which of vLLM's
backends and datasets it serves and what it tells a user who asks for another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vt.bench.stats import LATENCY_METRICS

# vLLM's --backend names that stream generated text, and the endpoint each one posts to.
COMPLETIONS_BACKENDS = ("openai", "vllm")
CHAT_BACKENDS = ("openai-chat",)
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}
# vLLM's other backends: audio, embeddings, pooling and reranking, which vt does not serve.
OTHER_VLLM_BACKENDS = ("openai-audio", "openai-embeddings", "openai-embeddings-chat",
                       "openai-embeddings-clip", "openai-embeddings-vlm2vec", "infinity-embeddings",
                       "infinity-embeddings-clip", "vllm-pooling", "vllm-rerank")

DATASETS = ("random", "sharegpt")
OTHER_VLLM_DATASETS = ("burstgpt", "sonnet", "random-mm", "random-rerank", "hf", "custom",
                       "prefix_repetition", "spec_bench", "txt-slices", "timed_trace")

DEFAULT_PERCENTILE_METRICS = LATENCY_METRICS   # vLLM prints ttft,tpot,itl by default; vt all four
DEFAULT_METRIC_PERCENTILES = (90.0, 99.0)      # vLLM's default is 99 alone; vt adds P90


@dataclass(frozen=True)
class BenchConfig:
    """Validated options of one benchmark invocation. The fields after `progress` have defaults,
    so that the scripts under bench/ that build a config of their own keep working."""

    base_url: str | None
    model_dir: str | None          # checkpoint: the server started here, and the tokenizer by default
    model_name: str | None         # name sent in requests (--served-model-name); None: see model_hint
    api_key: str | None
    serve_flags: tuple[str, ...]
    server_timeout: float
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    seed: int
    ignore_eos: bool
    temperature: float
    priority: int
    priority_mix: tuple[tuple[int, float], ...]
    request_rate: float
    max_concurrency: int | None
    goodput_slo_ms: dict[str, float] | None
    compare_async: bool
    repeats: int
    json_path: str | None
    plot_path: str | None
    progress: bool
    backend: str = "openai"
    endpoint: str = "/v1/completions"
    model_hint: str | None = None  # --model against a running server: sent when the server serves it
    tokenizer: str | None = None   # a folder with tokenizer.json; None: model_dir's, else the server's
    dataset_name: str = "random"
    dataset_path: str | None = None
    prefix_len: int = 0
    sharegpt_output_len: int | None = None
    burstiness: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS
    metric_percentiles: tuple[float, ...] = DEFAULT_METRIC_PERCENTILES
    save_result: bool = False
    save_detailed: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    label: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.backend in CHAT_BACKENDS

    @property
    def tokenizer_dir(self) -> str | None:
        """Where prompts are tokenized on this side; None: the server's /tokenize does it."""
        return self.tokenizer or self.model_dir
