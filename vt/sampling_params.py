"""SamplingParams: the per-request sampling settings, validated once and immutable afterwards."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vt.structured.spec import StructuredOutput
from vt.text.preview import preview

GREEDY_EPS = 1e-5  # temperatures below this mean greedy, on every backend
MAX_N = 128
MAX_LOGPROBS = 20
# Every stop string is searched for after every token, on the event loop: bound the work.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all stop strings together
# logit_bias and allowed_token_ids together: the sampler keeps one row of this many (token, bias)
# entries per running sequence on the device.
MAX_LOGIT_ENTRIES = 4096
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value


class SamplingParamsError(ValueError):
    """A bad sampling parameter; `.param` names the field (the HTTP layer reports it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(v: Any) -> bool:
    # bool is an int subclass, but `"max_tokens": true` is a client bug, not 1
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(name: str, v: Any) -> int:
    if not _is_int(v):
        raise SamplingParamsError(name, f"{name} must be an integer, got {preview(v)}")
    return v


def _check_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SamplingParamsError(name, f"{name} must be a number, got {preview(v)}")
    f = float(v)
    if not math.isfinite(f):
        raise SamplingParamsError(name, f"{name} must be finite, got {preview(v)}")
    return f


def _token_id_list(name: str, ids: Any) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)):
        raise SamplingParamsError(name, f"{name} must be a list of integers, got {preview(ids)}")
    for i in ids:
        if not _is_int(i) or i < 0:
            raise SamplingParamsError(name, f"{name} must be integers >= 0, got {preview(i)}")
    return tuple(ids)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None         # top logprobs per token, 0..20
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True  # false: added tokens that follow one another get no space
    structured: StructuredOutput | None = None  # a grammar the output must follow
    # Added to a token's logit before sampling (OpenAI's logit_bias); token id -> bias in
    # [-100, 100]. A dict is accepted and kept as (id, bias) pairs sorted by id.
    logit_bias: Any = None
    allowed_token_ids: Any = None       # only these tokens may be sampled (vLLM's field)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)

        n = _check_int("n", self.n)
        if not 1 <= n <= MAX_N:
            raise SamplingParamsError("n", f"n must be in [1, {MAX_N}], got {n}")

        if self.max_tokens is not None:
            mt = _check_int("max_tokens", self.max_tokens)
            if mt < 1:
                raise SamplingParamsError("max_tokens", f"max_tokens must be at least 1, got {mt}")

        t = _check_float("temperature", self.temperature)
        if t < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {t}")
        set_("temperature", t)

        p = _check_float("top_p", self.top_p)
        if not 0 < p <= 1:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {p}")
        set_("top_p", p)

        k = _check_int("top_k", self.top_k)
        if k < -1:
            raise SamplingParamsError("top_k", f"top_k must be -1, 0 (off) or >= 1, got {k}")

        mp = _check_float("min_p", self.min_p)
        if not 0 <= mp <= 1:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {mp}")
        set_("min_p", mp)

        if self.seed is not None:
            s = _check_int("seed", self.seed)
            if not 0 <= s < 2**64:
                raise SamplingParamsError("seed", f"seed must be in [0, 2**64), got {s}")

        set_("stop", self._normalize_stop(self.stop))
        set_("stop_token_ids", self._normalize_stop_ids(self.stop_token_ids))

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise SamplingParamsError(name, f"{name} must be a boolean, got {preview(value)}")

        mn = _check_int("min_tokens", self.min_tokens)
        if mn < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be >= 0, got {mn}")
        if self.max_tokens is not None and mn > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens ({mn}) must not exceed max_tokens ({self.max_tokens})")

        for name in ("presence_penalty", "frequency_penalty"):
            v = _check_float(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {v}")
            set_(name, v)

        rp = _check_float("repetition_penalty", self.repetition_penalty)
        if not rp > 0:
            raise SamplingParamsError("repetition_penalty", f"repetition_penalty must be > 0, got {rp}")
        set_("repetition_penalty", rp)

        if self.logprobs is not None:
            lp = _check_int("logprobs", self.logprobs)
            if not 0 <= lp <= MAX_LOGPROBS:
                raise SamplingParamsError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {lp}")

        set_("logit_bias", self._normalize_logit_bias(self.logit_bias))
        set_("allowed_token_ids", self._normalize_allowed(self.allowed_token_ids))

        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SamplingParamsError("structured", f"structured must be a StructuredOutput, got "
                                                    f"{type(self.structured).__name__}")
        if self.structured is not None and self.allowed_token_ids is not None:
            # a grammar's mask and the allowed set may leave no token at all
            raise SamplingParamsError("allowed_token_ids", "allowed_token_ids cannot be combined with "
                                                           "structured outputs or tool_choice required / "
                                                           "named; express the set in the grammar")

    @staticmethod
    def _normalize_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise SamplingParamsError(
                "stop", f"stop must be a string or a list of strings, got {preview(stop)}")
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str):
                raise SamplingParamsError("stop", f"stop strings must be strings, got {preview(s)}")
            if not s:
                raise SamplingParamsError("stop", "stop strings must not be empty")
        total = sum(len(s) for s in stop)
        if total > MAX_STOP_CHARS:
            raise SamplingParamsError(
                "stop", f"stop strings may hold at most {MAX_STOP_CHARS} characters in all, got {total}")
        return tuple(stop)

    @staticmethod
    def _normalize_stop_ids(ids: Any) -> tuple[int, ...]:
        return () if ids is None else _token_id_list("stop_token_ids", ids)

    @staticmethod
    def _normalize_logit_bias(bias: Any) -> tuple[tuple[int, float], ...] | None:
        if bias is None:
            return None
        items = bias.items() if isinstance(bias, dict) else bias
        if not isinstance(items, (list, tuple, type({}.items()))):
            raise SamplingParamsError(
                "logit_bias", f"logit_bias must map token ids to numbers, got {preview(bias)}")
        out: dict[int, float] = {}
        for entry in items:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise SamplingParamsError("logit_bias", f"logit_bias entries must be (token id, bias) "
                                                        f"pairs, got {preview(entry)}")
            tok, value = entry
            if isinstance(tok, str):  # JSON object keys are strings
                try:
                    tok = int(tok)
                except ValueError:
                    pass  # refused just below, by its text
            if not _is_int(tok) or tok < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids (integers "
                                                        f">= 0), got {preview(tok)}")
            v = _check_float("logit_bias", value)
            if not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-100, 100], got "
                                                        f"{preview(value)} for token {tok}")
            out[tok] = v
        if len(out) > MAX_LOGIT_ENTRIES:
            raise SamplingParamsError("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_ENTRIES} "
                                                    f"tokens, got {len(out)}")
        return tuple(sorted(out.items())) or None

    @staticmethod
    def _normalize_allowed(ids: Any) -> tuple[int, ...] | None:
        if ids is None:
            return None
        unique = tuple(sorted(set(_token_id_list("allowed_token_ids", ids))))
        if not unique:
            raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must not be empty: no "
                                                           "token could be sampled")
        if len(unique) > MAX_LOGIT_ENTRIES:
            raise SamplingParamsError("allowed_token_ids", f"allowed_token_ids may hold at most "
                                                           f"{MAX_LOGIT_ENTRIES} tokens, got {len(unique)}")
        return unique

    def logit_entries(self) -> tuple[tuple[int, ...], tuple[float, ...], bool] | None:
        """What the sampler adds to each logit: (token ids ascending, their biases, exclusive),
        where exclusive means every token not listed is masked out (allowed_token_ids). None when
        the request biases nothing."""
        bias = dict(self.logit_bias or ())
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            return ids, tuple(bias.get(i, 0.0) for i in ids), True
        if not bias:
            return None
        return tuple(bias), tuple(bias.values()), False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
