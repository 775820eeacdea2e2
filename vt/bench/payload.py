"""The body of one benchmark request, as vLLM's benchmark writes it for its backend: a streamed
completion (`openai`, `vllm`) or a streamed chat completion with the prompt as one user message
(`openai-chat`), usage included in the stream."""

from __future__ import annotations

from typing import Any

from vt.bench.config import BenchConfig
from vt.bench.datasets import Prompt


def request_payload(p: Prompt, model: str, cfg: BenchConfig) -> dict:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.chat:
        if p.text is None:
            raise ValueError("a chat request needs the prompt as text")
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": p.text}]}]
        body["max_completion_tokens"] = p.output_len
    else:
        body["prompt"] = p.text if p.text is not None else list(p.token_ids)
        body["max_tokens"] = p.output_len
    # greedy unless asked otherwise: vt compares outputs across runs (vLLM leaves it to the server)
    body["temperature"] = cfg.temperature
    if cfg.top_p is not None:
        body["top_p"] = cfg.top_p
    if cfg.top_k is not None:
        body["top_k"] = cfg.top_k
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if p.priority or cfg.priority_mix:
        body["priority"] = p.priority
    if cfg.temperature > 0:
        body["seed"] = cfg.seed + p.index  # same samples for the same prompt in every run
    return body
