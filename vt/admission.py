"""Admission checks: every value a request carries, checked against the model and the sampler.

SamplingParams checks what holds for any model (types, ranges). What depends on the model and
on the arrays the runner stages a request into is checked here, once, before the request is
queued: token ids against the vocabulary, integers against int32, floats against float32, id
lists against the sampler's fixed slots, `n` against the waiting queue. A value that passes can
never make a step fail. A failure is a SamplingParamsError naming the field (a 400 over HTTP).

A new request field plugs in by adding its check to `check_params` (or a sibling for non-sampling
fields) and its limit to `AdmissionLimits`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vt.preview import preview
from vt.sampling import SamplingParams, SamplingParamsError

INT32_MAX = 2**31 - 1
_F32 = np.finfo(np.float32)
F32_MAX = float(_F32.max)
F32_TINY = float(_F32.tiny)  # the smallest normal float32: kernels may flush denormals to zero


@dataclass(frozen=True)
class AdmissionLimits:
    """What a request's values are checked against."""

    vocab_size: int                  # logits width: every token id must be below it
    max_model_len: int               # prompt + output tokens
    max_waiting: int                 # the waiting queue: n engine requests must fit in it
    max_banned: int                  # sampler slots for ids banned while min_tokens is not reached
    eos_token_ids: frozenset[int]    # banned with stop_token_ids unless ignore_eos

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_model_len", "max_waiting", "max_banned"):
            if getattr(self, name) < 1:
                raise ValueError(f"AdmissionLimits.{name} must be at least 1")


def check_token_ids(ids: Sequence[int], limits: AdmissionLimits, param: str) -> None:
    """Every id an integer in [0, vocab_size)."""
    vocab = limits.vocab_size
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise SamplingParamsError(param, f"token id {preview(t)} in '{param}' is outside the vocabulary "
                                             f"[0, {vocab})")


def check_params(params: SamplingParams, limits: AdmissionLimits) -> SamplingParams:
    """`params` as the sampler will run them, or SamplingParamsError naming the field.

    Two values are normalised rather than refused, because their meaning survives exactly:
    top_k >= vocab_size keeps every token (off), and a top_p that float32 rounds below its
    smallest normal value keeps only the most likely token, as any positive top_p does.
    """
    if params.n > limits.max_waiting:
        raise SamplingParamsError(
            "n", f"n ({params.n}) exceeds the waiting queue ({limits.max_waiting} requests), so the "
                 f"request could never be admitted")
    changes: dict[str, object] = {}
    if params.top_k > INT32_MAX:
        raise SamplingParamsError("top_k", f"top_k must be at most {INT32_MAX}, got {params.top_k}")
    if params.top_k >= limits.vocab_size:
        changes["top_k"] = 0
    if params.temperature > F32_MAX:
        raise SamplingParamsError("temperature", f"temperature must be at most {F32_MAX:.4g} (float32), "
                                                 f"got {params.temperature}")
    if float(np.float32(params.top_p)) < F32_TINY:
        changes["top_p"] = F32_TINY
    if float(np.float32(params.repetition_penalty)) < F32_TINY:
        raise SamplingParamsError("repetition_penalty", f"repetition_penalty must be at least "
                                                        f"{F32_TINY:.4g} (float32), got "
                                                        f"{params.repetition_penalty}")
    check_token_ids(params.stop_token_ids, limits, "stop_token_ids")
    if params.min_tokens > 0:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(limits.eos_token_ids))
        if len(banned) > limits.max_banned:
            raise SamplingParamsError(
                "stop_token_ids", f"with min_tokens set, at most {limits.max_banned} distinct stop "
                                  f"token ids (end-of-sequence ids included) can be held back; got "
                                  f"{len(banned)}")
    return dataclasses.replace(params, **changes) if changes else params
