"""--seed seeds the sampling of requests that bring no seed: the same server seed samples the same
tokens after a restart, another seed other tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from vt.llm import LLM
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams

SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)  # no per-request seed


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("seed") / "m")


def sample(model: Path, seed: int) -> list[list[int]]:
    with LLM(str(model), device="cpu", seed=seed, max_model_len=256) as llm:
        return [c.token_ids for c in llm.generate(["hello world", "the quick brown fox"], SAMPLED)]


def test_unseeded_requests_follow_the_server_seed(model):
    first = sample(model, 3)
    assert sample(model, 3) == first
    assert sample(model, 4) != first
    assert first[0] != first[1]
