"""`vt serve --tensor-parallel-size 2` (numpy ranks) answers as the one-rank server does."""

from __future__ import annotations

import os

import openai
import pytest

from tests.e2e.conftest import start_server

# Tensor-parallel ranks are numpy backends for now; on CUDA the flag is a start-up error
# (tests/unit/test_tensor_parallel.py), so there is nothing to compare against a CUDA server.
pytestmark = pytest.mark.skipif(os.environ.get("VT_TEST_DEVICE", "cpu") != "cpu",
                                reason="tensor parallelism runs on the numpy backend only")


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir):
    handle = start_server(tiny_model_dir, "--tensor-parallel-size", "2", "--scheduling-policy", "priority")
    yield handle
    handle.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def test_two_ranks_serve_the_tokens_and_logprobs_of_one(vt_server, two_ranks, tiny_model_dir):
    assert "2 tensor-parallel ranks" in two_ranks.output()
    one, two = _client(vt_server.url), _client(two_ranks.url)
    model = str(tiny_model_dir)
    kw = dict(model=model, prompt="the quick brown fox", max_tokens=12, temperature=0.0, logprobs=3,
              extra_body={"ignore_eos": True})
    a, b = one.completions.create(**kw).choices[0], two.completions.create(**kw).choices[0]
    assert b.text == a.text and b.logprobs.tokens == a.logprobs.tokens
    for x, y in zip(a.logprobs.token_logprobs, b.logprobs.token_logprobs, strict=True):
        assert y == pytest.approx(x, abs=1e-4)
    seeded = dict(model=model, prompt="once upon a time", max_tokens=12, temperature=0.9, seed=5, n=2)
    # a priority only where priority scheduling is on: the one-rank server is fcfs
    prioritised = two.completions.create(**seeded, extra_body={"ignore_eos": True, "priority": -1})
    assert ([c.text for c in prioritised.choices]
            == [c.text for c in one.completions.create(**seeded, extra_body={"ignore_eos": True}).choices])
    chat = dict(model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=10,
                temperature=0.0, stream=True)
    texts = ["".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat)
                     if c.choices) for client in (one, two)]
    assert texts[0] and texts[1] == texts[0]
