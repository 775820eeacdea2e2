"""`vt bench`'s datasets sampled as `vllm bench serve` samples them: random lengths spread by the
range ratio over vLLM's bounds and drawn as vLLM draws them, a shared random prefix, and ShareGPT
files read, filtered, shuffled and topped up as vLLM reads them (vllm/benchmarks/datasets.py)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from vt.bench.client import BenchError
from vt.bench.config import BenchConfig
from vt.bench.datasets import check_random_lengths, length_range, load_sharegpt, make_prompts, sample_sharegpt

POOL = list(range(100, 400))


def config(**kw) -> BenchConfig:
    base = dict(base_url=None, model_dir=None, model_name=None, api_key=None, serve_flags=(),
                server_timeout=1.0, num_prompts=50, input_len=10, output_len=6, range_ratio=0.0, seed=0,
                ignore_eos=True,
                temperature=0.0, priority=0, priority_mix=(), request_rate=float("inf"), max_concurrency=None,
                goodput_slo_ms=None, compare_async=False, repeats=1, json_path=None, plot_path=None,
                progress=False)
    return BenchConfig(**{**base, **kw})


# ---------------------------------------------------------------- random


def test_range_ratio_bounds_are_vllms_floor_and_ceil() -> None:
    # L=10, r=0.25: floor(7.5) = 7 to ceil(12.5) = 13, both included
    assert length_range(10, 0.25, floor_at_one=False) == (7, 13)
    # output lengths never go below 1: L=1, r=0.5 gives floor(0.5)=0 -> 1, ceil(1.5) = 2
    assert length_range(1, 0.5, floor_at_one=True) == (1, 2)
    assert length_range(1, 0.5, floor_at_one=False) == (0, 2)


def test_random_lengths_cover_the_whole_range_and_nothing_else() -> None:
    prompts = make_prompts(POOL, config(num_prompts=400, input_len=10, output_len=4, range_ratio=0.25))
    assert {len(p.token_ids) for p in prompts} == set(range(7, 14))
    assert {p.output_len for p in prompts} == set(range(3, 6))  # floor(3.0) = 3 to ceil(5.0) = 5


def test_random_lengths_are_the_draws_of_vllms_generator() -> None:
    """The same seed gives vLLM's lengths: numpy default_rng(seed), input lengths then output lengths."""
    cfg = config(num_prompts=30, input_len=100, output_len=20, range_ratio=0.5, seed=7)
    rng = np.random.default_rng(7)
    want_in = rng.integers(50, 150 + 1, size=30).tolist()
    want_out = rng.integers(10, 30 + 1, size=30).tolist()
    prompts = make_prompts(POOL, cfg)
    assert [len(p.token_ids) for p in prompts] == want_in
    assert [p.output_len for p in prompts] == want_out


def test_random_prompts_are_exact_length_pool_ids_and_seeded() -> None:
    cfg = config(num_prompts=20, input_len=12)
    prompts = make_prompts(POOL, cfg)
    assert all(len(p.token_ids) == 12 and p.output_len == 6 for p in prompts)
    assert all(set(p.token_ids) <= set(POOL) for p in prompts)
    assert [p.index for p in prompts] == list(range(20))
    assert make_prompts(POOL, cfg) == prompts
    assert make_prompts(POOL, replace(cfg, seed=1)) != prompts
    assert len({p.token_ids for p in prompts}) == 20  # no two prompts alike: no accidental prefix hits


def test_random_prefix_is_shared_and_comes_before_the_sampled_length() -> None:
    prompts = make_prompts(POOL, config(num_prompts=10, input_len=8, range_ratio=0.5, prefix_len=5))
    prefix = prompts[0].token_ids[:5]
    assert all(p.token_ids[:5] == prefix for p in prompts)
    # total = prefix + a length drawn from [floor(4), ceil(12)]
    assert all(5 + 4 <= len(p.token_ids) <= 5 + 12 for p in prompts)
    assert len({p.token_ids[5:] for p in prompts}) == 10


def test_too_short_random_prompts_are_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        check_random_lengths(1, 0.5, 0)   # floor(0.5) = 0 tokens
    check_random_lengths(1, 0.5, 1)       # a prefix token is enough, as in vLLM
    with pytest.raises(BenchError, match="no usable token ids"):
        make_prompts([], config())


# ---------------------------------------------------------------- ShareGPT


def turns(prompt: str, reply: str, *more: str) -> dict:
    conv = [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]
    conv += [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(more)]
    return {"id": prompt[:8], "conversations": conv}


def words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


async def count_words(texts: Sequence[str]) -> list[list[int]]:
    """A stand-in tokenizer: one token per word, plus a BOS, as a tokenizer call with special tokens."""
    return [[1] + [7] * len(t.split()) for t in texts]


def write(tmp_path: Path, entries: object) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return str(path)


def sample(path: str, **kw) -> list:
    cfg = config(dataset_name="sharegpt", dataset_path=path, **kw)
    return asyncio.run(sample_sharegpt(load_sharegpt(path, cfg.seed), cfg, count_words))


def test_sharegpt_prompt_is_the_first_turn_and_output_the_replys_token_count(tmp_path: Path) -> None:
    path = write(tmp_path, [turns(words(5, "a"), words(9, "b"), "next question", "next reply")])
    (p,) = sample(path, num_prompts=1)
    assert p.text == words(5, "a")            # sent as text
    assert len(p.token_ids) == 6              # 5 words + BOS, counted with special tokens as vLLM counts
    assert p.output_len == 10                 # the reply's count (9 words + BOS), as vLLM's quirk has it


def test_sharegpt_filter_is_vllms(tmp_path: Path) -> None:
    entries = [
        turns(words(3), words(10)),            # prompt 4 tokens: kept (min 4)
        turns(words(2), words(10)),            # prompt 3 tokens: too short
        turns(words(10), words(2)),            # reply 3 tokens: too short
        turns(words(1023), words(10)),         # prompt 1024: kept (max 1024)
        turns(words(1024), words(10)),         # prompt 1025: too long
        turns(words(1000), words(1047)),       # 1001 + 1048 = 2049: too long together
        turns(words(1000), words(1046)),       # 1001 + 1047 = 2048: kept
        {"conversations": [{"from": "human", "value": words(10)}]},  # one turn: dropped
        {"no": "conversations"},
    ]
    kept = sample(write(tmp_path, entries), num_prompts=3)
    assert sorted((len(p.token_ids), p.output_len) for p in kept) == [(4, 11), (1001, 1047), (1024, 11)]


def test_sharegpt_output_len_overrides_the_reply_and_its_minimum(tmp_path: Path) -> None:
    path = write(tmp_path, [turns(words(10), words(1)), turns(words(10), words(1500))])
    kept = sample(path, num_prompts=2, sharegpt_output_len=7)
    # the 1-word reply passes (no minimum with a fixed length); 11 + 7 <= 2048 for both
    assert sorted((len(p.token_ids), p.output_len) for p in kept) == [(11, 7), (11, 7)]


def test_sharegpt_order_is_vllms_seeded_shuffle(tmp_path: Path) -> None:
    entries = [turns(words(4 + i), words(10)) for i in range(12)]
    kept = sample(write(tmp_path, entries), num_prompts=12, seed=3)
    order = list(range(12))
    random.Random(3).shuffle(order)  # vLLM: random.seed(seed); random.shuffle(entries)
    assert [len(p.token_ids) - 5 for p in kept] == order
    assert [p.index for p in kept] == list(range(12))


def test_sharegpt_too_few_are_topped_up_from_the_kept_ones(tmp_path: Path) -> None:
    entries = [turns(words(4), words(10)), turns(words(6), words(10)), turns(words(1), words(1))]
    path = write(tmp_path, entries)
    kept = sample(path, num_prompts=7)
    assert len(kept) == 7 and [p.index for p in kept] == list(range(7))
    assert {len(p.token_ids) for p in kept} == {5, 7}


def test_sharegpt_stops_counting_once_enough_pass(tmp_path: Path) -> None:
    seen: list[str] = []

    async def counting(texts: Sequence[str]) -> list[list[int]]:
        seen.extend(texts)
        return await count_words(texts)

    path = write(tmp_path, [turns(words(5), words(10)) for _ in range(500)])
    cfg = config(dataset_name="sharegpt", dataset_path=path, num_prompts=3)
    asyncio.run(sample_sharegpt(load_sharegpt(path, 0), cfg, counting))
    assert len(seen) < 2 * 500


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "not JSON"),
    ('{"conversations": []}', "is a JSON object"),
    ("[]", "no entry has a \"conversations\" list"),
    ('[{"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]', "entry 0: conversations[0]"),
])
def test_bad_sharegpt_files_are_clear_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(BenchError, match=message.replace("[", r"\[")):
        sample(str(path), num_prompts=1)


def test_sharegpt_with_nothing_passing_the_filter_says_so(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="no conversation passes vLLM's ShareGPT filter"):
        sample(write(tmp_path, [turns("hi", "hello")]), num_prompts=2)
