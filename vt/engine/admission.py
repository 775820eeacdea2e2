"""Admission checks: every value a request carries, checked against the model and the sampler.

SamplingParams checks what holds for any model (types, ranges). What depends on the model and
on the arrays the runner stages a request into is checked here, once, before the request is
queued: token ids against the vocabulary, integers against int32, floats against float32, id
lists against the sampler's fixed slots, the sequences a request adds against the waiting queue,
its length against the context and the KV cache, its priority against the scheduling policy. A
value that passes can never make a step fail, and a request that passes can always be admitted
once the queue has room. A failure is a SamplingParamsError naming the field (a 400 over HTTP).

A new request field plugs in by adding its check to `check_params` (or a sibling for non-sampling
fields) and its limit to `AdmissionLimits`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence, Set
from dataclasses import dataclass

import numpy as np

from vt.sampling_params import SamplingParams, SamplingParamsError
from vt.text.preview import preview

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
    kv_tokens: int | None = None     # KV cache slots: a sequence's prompt + output - 1 must fit
    priority_scheduling: bool = True  # False (fcfs): a request's priority would be ignored

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_model_len", "max_waiting", "max_banned"):
            if getattr(self, name) < 1:
                raise ValueError(f"AdmissionLimits.{name} must be at least 1")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError("AdmissionLimits.kv_tokens must be at least 1")


def check_token_ids(ids: Sequence[int], limits: AdmissionLimits, param: str) -> None:
    """Every id an integer in [0, vocab_size)."""
    vocab = limits.vocab_size
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise SamplingParamsError(param, f"token id {preview(t)} in '{param}' is outside the vocabulary "
                                             f"[0, {vocab})")


def check_params(params: SamplingParams, limits: AdmissionLimits, num_prompts: int = 1) -> SamplingParams:
    """`params` as the sampler will run them, or SamplingParamsError naming the field.

    A request adds `num_prompts * n` sequences to the waiting queue at once; more than the queue
    holds could never be admitted, so it is refused here rather than told to retry.

    Two values are normalised rather than refused, because their meaning survives exactly:
    top_k >= vocab_size keeps every token (off), and a top_p that float32 rounds below its
    smallest normal value keeps only the most likely token, as any positive top_p does.
    """
    if params.n > limits.max_waiting:
        raise SamplingParamsError(
            "n", f"n ({params.n}) exceeds the waiting queue ({limits.max_waiting} requests), so the "
                 f"request could never be admitted")
    if num_prompts * params.n > limits.max_waiting:
        raise SamplingParamsError(
            "prompt", f"the request adds {num_prompts * params.n} sequences ({num_prompts} prompts x n "
                      f"{params.n}), more than the waiting queue holds ({limits.max_waiting}), so it "
                      f"could never be admitted; send fewer prompts per request")
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
    if params.repetition_penalty > F32_MAX or float(np.float32(params.repetition_penalty)) < F32_TINY:
        raise SamplingParamsError("repetition_penalty", f"repetition_penalty must be in [{F32_TINY:.4g}, "
                                                        f"{F32_MAX:.4g}] (float32), got "
                                                        f"{params.repetition_penalty}")
    check_token_ids(params.stop_token_ids, limits, "stop_token_ids")
    if params.logit_bias is not None:
        check_token_ids([t for t, _ in params.logit_bias], limits, "logit_bias")
    if params.allowed_token_ids is not None:
        check_token_ids(params.allowed_token_ids, limits, "allowed_token_ids")
    if params.min_tokens > 0:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(limits.eos_token_ids))
        if len(banned) > limits.max_banned:
            raise SamplingParamsError(
                "stop_token_ids", f"with min_tokens set, at most {limits.max_banned} distinct stop "
                                  f"token ids (end-of-sequence ids included) can be held back; got "
                                  f"{len(banned)}")
    check_first_token(params, limits.eos_token_ids, limits.vocab_size)  # a grammar's start: add_request
    return dataclasses.replace(params, **changes) if changes else params


def held_back(params: SamplingParams, eos_token_ids: Set[int], num_output: int) -> frozenset[int]:
    """The ids min_tokens holds back while the request's output token num_output + 1 is sampled."""
    if num_output >= params.min_tokens:
        return frozenset()
    eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
    return frozenset(params.stop_token_ids) | eos


def check_first_token(params: SamplingParams, eos_token_ids: Set[int], vocab_size: int,
                      grammar_mask: np.ndarray | None = None, grammar_complete: bool = False) -> None:
    """SamplingParamsError naming the field if the request's first token could be no token at all:
    every token its allowed_token_ids, or its grammar, allows is one min_tokens holds back. The
    one check of a row left with nothing to sample that admission can make (engine/allowed_tokens.py
    says what a step does where it shows only later).

    grammar_mask: the bitmask (i32 words, llguidance's layout) of the tokens the request's grammar
    allows first, once compiled (AsyncEngine.add_request); grammar_complete: the grammar accepts
    the empty output, which then ends there rather than fail."""
    banned = held_back(params, eos_token_ids, 0)
    if params.allowed_token_ids is not None and banned.issuperset(params.allowed_token_ids):
        raise SamplingParamsError(
            "allowed_token_ids", f"every token in allowed_token_ids is a stop token held back until "
                                 f"min_tokens ({params.min_tokens}) is reached, so no token could be sampled")
    if grammar_mask is None or grammar_complete:
        return
    allowed = np.unpackbits(np.ascontiguousarray(grammar_mask, np.int32).view(np.uint8),
                            bitorder="little")[:vocab_size].astype(bool)
    allowed[[t for t in banned if t < vocab_size]] = False
    if not allowed.any():
        raise SamplingParamsError(
            "min_tokens", f"the structured output can only start with tokens that min_tokens "
                          f"({params.min_tokens}) holds back (the end of sequence and stop_token_ids), "
                          f"so no token could be sampled")


def check_priority(priority: int, limits: AdmissionLimits) -> None:
    """A priority other than 0 needs priority scheduling: first-come first-served would ignore it."""
    if priority != 0 and not limits.priority_scheduling:
        raise SamplingParamsError(
            "priority", f"priority scheduling is not enabled (got priority {priority}); start the "
                        f"server with --scheduling-policy priority, or send priority 0")


def fit_context(num_prompt_tokens: int, params: SamplingParams, limits: AdmissionLimits, *,
                max_tokens_given: bool, prompt_param: str = "prompt",
                max_tokens_param: str = "max_tokens") -> SamplingParams:
    """`params` for one prompt of `num_prompt_tokens` tokens, or SamplingParamsError naming the
    prompt or the max_tokens field that does not fit the context or the KV cache.

    A max_tokens the request did not give (a server default) is lowered to what the context
    leaves instead of refused; one it gave must fit as given.
    """
    n, mml = num_prompt_tokens, limits.max_model_len
    if n >= mml:
        raise SamplingParamsError(
            prompt_param, f"the prompt has {n} tokens; this model's maximum context length is {mml} "
                          f"tokens, prompt and output together")
    room = mml - n
    max_tokens = params.max_tokens
    if max_tokens is not None and max_tokens > room:
        if max_tokens_given:
            raise SamplingParamsError(
                max_tokens_param, f"this model's maximum context length is {mml} tokens; the request "
                                  f"has {n} prompt tokens and '{max_tokens_param}' {max_tokens} "
                                  f"({n + max_tokens} in all), so '{max_tokens_param}' may be at "
                                  f"most {room}")
        params = dataclasses.replace(params, max_tokens=room)
    kv = limits.kv_tokens
    # the last sampled token is never fed back: prompt + output - 1 slots at most
    need = n + (room if params.max_tokens is None else params.max_tokens) - 1
    if kv is not None and need > kv:
        param = max_tokens_param if max_tokens_given and n <= kv else prompt_param
        raise SamplingParamsError(
            param, f"the request needs up to {need} tokens of KV cache ({n} prompt tokens and up to "
                   f"{need + 1 - n} output tokens) and the server holds {kv}; lower '{param}'")
    return params
