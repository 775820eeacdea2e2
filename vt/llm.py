"""LLM: a blocking facade over AsyncEngine for scripts, `vt generate` and tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None


class LLM:
    """`LLM(model_dir, max_num_seqs=8).generate(["hi"], SamplingParams(max_tokens=8))`."""

    def __init__(self, model: str, **engine_args: object) -> None:
        self._loop = asyncio.new_event_loop()
        self.engine = AsyncEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._loop.run_until_complete(self.engine.start())
        self._next = 0

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 priorities: list[int] | None = None) -> list[Completion]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        pri = priorities or [0] * len(prompts)
        return self._loop.run_until_complete(self._generate(prompts, plist, pri))

    async def _generate(self, prompts: list, plist: list[SamplingParams], pri: list[int]) -> list[Completion]:
        streams = []
        for prompt, p, prio in zip(prompts, plist, pri):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._next += 1
            streams.append((ids, self.engine.add_request(f"llm-{self._next}", ids, p, prio)))

        async def collect(ids: list[int], stream) -> Completion:
            toks, text, last = [], [], None
            async for out in stream:
                toks.extend(out.token_ids)
                text.append(out.text)
                last = out
            return Completion(ids, toks, "".join(text), last.finish_reason, last.stop_reason)

        return list(await asyncio.gather(*(collect(i, s) for i, s in streams)))

    def embed(self, prompts: list[str | list[int]], dimensions: int | None = None) -> list[np.ndarray]:
        """An embedding model's vectors (float32), one per prompt (`dimensions`: Matryoshka
        truncation), as vLLM's LLM.embed gives them."""
        return self._loop.run_until_complete(self._embed(prompts, dimensions))

    async def _embed(self, prompts: list[str | list[int]], dimensions: int | None) -> list[np.ndarray]:
        streams = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._next += 1
            streams.append(self.engine.embed(f"llm-{self._next}", ids, dimensions))

        async def last(stream) -> np.ndarray:
            async for out in stream:
                if out.finished:
                    if out.embedding is None:
                        raise RuntimeError(out.error or f"no vector ({out.finish_reason})")
                    return out.embedding
            raise RuntimeError("the request's stream ended without its output")

        return list(await asyncio.gather(*(last(s) for s in streams)))

    def close(self) -> None:
        self._loop.run_until_complete(self.engine.stop())
        self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
