"""`vt bench`'s datasets, sampled as `vllm bench serve` samples them (vllm/benchmarks/datasets.py).

random: input and output lengths drawn uniformly over the integers in [floor(L*(1-r)),
ceil(L*(1+r))] (output at least 1) from numpy's default_rng(seed), input lengths first, as vLLM
draws them, so the same seed gives vLLM's lengths; a prefix of --random-prefix-len tokens, drawn
once, goes before every prompt. Where vt differs: the tokens are ids drawn uniformly from the
tokenizer's non-special ids and sent as ids, so every prompt has its exact length (vLLM builds a
run of consecutive ids, decodes it to text and re-encodes it, which can shift a length by a
token); vt draws lengths around L itself, where vLLM draws around L less the tokenizer's BOS and
lets the server add it back.

sharegpt: vLLM's ShareGPT reading. Entries with at least two turns in "conversations", shuffled
with random.Random(seed); turn 0 is the prompt (sent as text) and turn 1 the reply whose token
count is the output length unless --sharegpt-output-len; a pair is kept where the prompt has 4 to
1024 tokens, the reply at least 4 (unchecked with --sharegpt-output-len) and both together at most
2048, counted with special tokens as vLLM's tokenizer call counts them; too few kept pairs are
topped up by random.Random(seed).choice among them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import orjson

from vt.bench.client import BenchError
from vt.bench.config import BenchConfig

# vLLM's is_valid_sequence bounds (dataset_utils.py), from its original ShareGPT sampler
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
TOKENIZE_BATCH = 64  # texts counted at once while sampling; sampling stops as soon as enough pass


@dataclass(frozen=True)
class Prompt:
    """One request of the dataset: token ids, or text (sent as text) with its token ids as
    counted on this side; the server's usage count replaces that count in the records."""

    index: int
    token_ids: tuple[int, ...]
    output_len: int
    priority: int
    text: str | None = None


# ---------------------------------------------------------------- random


def length_range(length: int, ratio: float, floor_at_one: bool) -> tuple[int, int]:
    """vLLM's bounds: floor(L*(1-r)) to ceil(L*(1+r)), both included (output ones at least 1)."""
    lo, hi = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    return (max(lo, 1), max(hi, 1)) if floor_at_one else (lo, hi)


def check_random_lengths(input_len: int, ratio: float, prefix_len: int) -> None:
    """Every random prompt must have a token, as vLLM checks before sampling."""
    lo, _ = length_range(input_len, ratio, floor_at_one=False)
    if prefix_len + lo < 1:
        raise ValueError(f"--random-input-len {input_len} is too small for --random-range-ratio {ratio:g}: "
                         f"the shortest prompt would have {prefix_len + lo} tokens; raise --random-input-len "
                         "or --random-prefix-len, or lower --random-range-ratio")


def _priorities(rng: random.Random, n: int, default: int, mix: tuple[tuple[int, float], ...]) -> list[int]:
    """Exact counts per share (rounded), shuffled, so small runs still get the asked-for mix."""
    out: list[int] = []
    for prio, share in mix:
        out += [prio] * round(share * n)
    out = out[:n] + [default] * max(0, n - len(out))
    rng.shuffle(out)
    return out


def make_prompts(pool: list[int], cfg: BenchConfig) -> list[Prompt]:
    """Random prompts of exact token lengths drawn from `pool` (real ids of the served tokenizer)."""
    if not pool:
        raise BenchError("the tokenizer gave no usable token ids for prompts")
    try:
        check_random_lengths(cfg.input_len, cfg.range_ratio, cfg.prefix_len)
    except ValueError as e:
        raise BenchError(str(e)) from None
    n = cfg.num_prompts
    rng = np.random.default_rng(cfg.seed)
    in_lo, in_hi = length_range(cfg.input_len, cfg.range_ratio, floor_at_one=False)
    out_lo, out_hi = length_range(cfg.output_len, cfg.range_ratio, floor_at_one=True)
    ins = rng.integers(in_lo, in_hi + 1, size=n).tolist()
    outs = rng.integers(out_lo, out_hi + 1, size=n).tolist()
    ids = np.asarray(pool)
    prefix = tuple(ids[rng.integers(0, len(ids), size=cfg.prefix_len)].tolist())
    prios = _priorities(random.Random(cfg.seed), n, cfg.priority, cfg.priority_mix)
    return [Prompt(i, prefix + tuple(ids[rng.integers(0, len(ids), size=ins[i])].tolist()), outs[i], prios[i])
            for i in range(n)]


# ---------------------------------------------------------------- ShareGPT


def is_valid_sequence(prompt_len: int, output_len: int, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's ShareGPT filter."""
    return not (prompt_len < SHAREGPT_MIN_LEN
                or (not skip_min_output_len_check and output_len < SHAREGPT_MIN_LEN)
                or prompt_len > SHAREGPT_MAX_PROMPT_LEN
                or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN)


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT entry with two turns or more; `number` is its place in the file (from 0)."""

    number: int
    turns: list

    def pair(self, path: str) -> tuple[str, str]:
        """Turn 0 (the prompt) and turn 1 (the reply), as vLLM takes them."""
        texts = []
        for t in (0, 1):
            turn = self.turns[t]
            value = turn.get("value") if isinstance(turn, dict) else None
            if not isinstance(value, str):
                raise BenchError(f"--dataset-path {path}: entry {self.number}: conversations[{t}] has no "
                                 "text \"value\" (ShareGPT turns look like {\"from\": \"human\", \"value\": "
                                 "\"...\"})")
            texts.append(value)
        return texts[0], texts[1]


def load_sharegpt(path: str, seed: int) -> list[Conversation]:
    """The file's entries with at least two turns, shuffled as vLLM shuffles them."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except OSError as e:
        raise BenchError(f"--dataset-path {path}: cannot read it: {e.strerror or e}") from None
    except orjson.JSONDecodeError as e:
        raise BenchError(f"--dataset-path {path}: not JSON: {e}") from None
    if not isinstance(data, list):
        kind = {dict: "object", str: "string", bool: "boolean"}.get(type(data), "number or null")
        raise BenchError(f"--dataset-path {path}: a ShareGPT file is a JSON list of "
                         f"{{\"conversations\": [...]}} entries, this one is a JSON {kind}")
    kept = [Conversation(i, e["conversations"]) for i, e in enumerate(data)
            if isinstance(e, dict) and isinstance(e.get("conversations"), list)
            and len(e["conversations"]) >= 2]
    if not kept:
        raise BenchError(f"--dataset-path {path}: no entry has a \"conversations\" list of two turns or more")
    random.Random(seed).shuffle(kept)
    return kept


TokenizeTexts = Callable[[Sequence[str]], Awaitable[list[list[int]]]]


async def sample_sharegpt(conversations: list[Conversation], cfg: BenchConfig,
                          tokenize: TokenizeTexts) -> list[Prompt]:
    """cfg.num_prompts prompts from the shuffled conversations; `tokenize` counts with special tokens."""
    assert cfg.dataset_path is not None
    n, fixed = cfg.num_prompts, cfg.sharegpt_output_len
    kept: list[tuple[str, tuple[int, ...], int]] = []
    for start in range(0, len(conversations), TOKENIZE_BATCH):
        pairs = [c.pair(cfg.dataset_path) for c in conversations[start:start + TOKENIZE_BATCH]]
        ids = await tokenize([text for pair in pairs for text in pair])
        for i, (prompt, _) in enumerate(pairs):
            prompt_ids, reply_ids = ids[2 * i], ids[2 * i + 1]
            output_len = len(reply_ids) if fixed is None else fixed
            if is_valid_sequence(len(prompt_ids), output_len, skip_min_output_len_check=fixed is not None):
                kept.append((prompt, tuple(prompt_ids), output_len))
            if len(kept) >= n:
                break
        if len(kept) >= n:
            break
    if not kept:
        raise BenchError(f"--dataset-path {cfg.dataset_path}: no conversation passes vLLM's ShareGPT filter "
                         f"(prompt {SHAREGPT_MIN_LEN} to {SHAREGPT_MAX_PROMPT_LEN} tokens, reply at least "
                         f"{SHAREGPT_MIN_LEN}, both at most {SHAREGPT_MAX_TOTAL_LEN})")
    if len(kept) < n:  # vLLM's oversampling: picks among the kept ones, drawn anew from the seed
        rng, found = random.Random(cfg.seed), list(kept)
        kept += [rng.choice(found) for _ in range(n - len(found))]
    prios = _priorities(random.Random(cfg.seed), n, cfg.priority, cfg.priority_mix)
    return [Prompt(i, ids, out, prios[i], text) for i, (text, ids, out) in enumerate(kept)]


def with_text(prompts: list[Prompt], texts: Sequence[str]) -> list[Prompt]:
    """The prompts with their ids written out as text (what a chat message carries)."""
    return [replace(p, text=t) for p, t in zip(prompts, texts, strict=True)]
