"""Through the API, async scheduling on and off give the same tokens: 32 concurrent requests of
mixed lengths, greedy and seeded, some with logit_bias or allowed_token_ids, on a KV pool small
enough that some of them are preempted."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import orjson
import pytest

from tests.e2e.conftest import start_server
from tests.e2e.test_reliability import metrics, wait_idle

N = 32


def _requests() -> list[dict]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(N):
        body = {"prompt": rng.integers(3, 900, size=int(rng.integers(4, 60))).tolist(),
                "max_tokens": int(rng.integers(8, 40)), "ignore_eos": True, "logprobs": 0,
                "stream": bool(i % 2), "return_tokens_as_token_ids": True}
        if i % 3:
            body.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        else:
            body["temperature"] = 0.0
        if i % 4 == 1:  # the sampler's bias lines, written at (re)admission, under preemption too
            body["allowed_token_ids"] = sorted(rng.choice(900, 20, replace=False).tolist())
            body["logit_bias"] = {str(body["allowed_token_ids"][0]): 2.0}
        elif i % 4 == 3:
            body["logit_bias"] = {str(int(rng.integers(3, 900))): 100, "5": -100}
        out.append(body)
    return out


async def _run(url: str, bodies: list[dict]) -> list[list[int]]:
    """Token ids of every request (from logprobs, which carry one entry per generated token)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(body: dict) -> list[int]:
            if not body["stream"]:
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["logprobs"]["tokens"]
            tokens: list[str] = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        lp = orjson.loads(line[6:])["choices"][0]["logprobs"]
                        if lp:
                            tokens.extend(lp["tokens"])
            return tokens

        return list(await asyncio.gather(*(one(b) for b in bodies)))


@pytest.fixture(scope="module")
def outputs(tiny_model_dir) -> dict[str, tuple[list, dict]]:
    bodies = _requests()
    res = {}
    for arm in ("--async-scheduling", "--no-async-scheduling"):
        server = start_server(tiny_model_dir, arm, "--num-gpu-blocks", "24", "--block-size", "16",
                              "--max-model-len", "384", "--max-num-seqs", "16")
        try:
            toks = asyncio.run(_run(server.url, bodies))
            res[arm] = (toks, wait_idle(server))
            res[arm][1].update(metrics(server))
        finally:
            assert server.stop() == 0
    return res


def test_async_on_and_off_stream_the_same_tokens(outputs) -> None:
    on, off = outputs["--async-scheduling"][0], outputs["--no-async-scheduling"][0]
    bodies = _requests()
    assert [len(t) for t in on] == [b["max_tokens"] for b in bodies]
    assert on == off


def test_biased_requests_sample_what_their_bias_asks(outputs) -> None:
    """allowed_token_ids bounds every sampled token; a +100 bias makes its token the only one
    sampled (greedy or not: the other logits of a random model are within a few units)."""
    bodies = _requests()
    for body, tokens in zip(bodies, outputs["--async-scheduling"][0], strict=True):
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
        if "allowed_token_ids" in body:
            assert set(ids) <= set(body["allowed_token_ids"]), (body, ids)
        elif "logit_bias" in body:
            forced = next(int(k) for k, v in body["logit_bias"].items() if v == 100)
            assert set(ids) == {forced}, (body, ids)
    assert sum("allowed_token_ids" in b for b in bodies) == 8


def test_the_small_pool_preempted_and_nothing_leaked(outputs) -> None:
    for _, m in outputs.values():
        assert m["vt:num_preemptions_total"] > 0
        assert m["vt:kv_cache_usage_perc"] == 0
