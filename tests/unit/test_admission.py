"""Admission checks against the model, bounded error previews, and parsing that cannot recurse."""

from __future__ import annotations

import pytest

from vt.engine.admission import F32_TINY, AdmissionLimits, check_params
from vt.http.protocol import ProtocolError, get_int, parse_completion_request, parse_prompts
from vt.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams, SamplingParamsError
from vt.structured.spec import GrammarSpec, StructuredOutput
from vt.text.preview import preview

LIMITS = AdmissionLimits(vocab_size=1024, max_model_len=256, max_waiting=8, max_banned=16,
                         eos_token_ids=frozenset({1, 2}))


def nested(depth: int, leaf: object = 1) -> object:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": 2**62}, "top_k"),
    ({"stop_token_ids": (1024,)}, "stop_token_ids"),
    ({"stop_token_ids": (2**31,), "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": tuple(range(100, 115)), "min_tokens": 1}, "stop_token_ids"),  # 15 + 2 eos > 16
    ({"n": 9}, "n"),
    ({"temperature": 1e39}, "temperature"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"logit_bias": {"1024": 1}}, "logit_bias"),
    ({"allowed_token_ids": [5, 1024]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 2, 7], "stop_token_ids": (7,), "min_tokens": 1}, "allowed_token_ids"),
    ({"allowed_token_ids": [5], "structured": StructuredOutput(GrammarSpec("regex", "a+"))},
     "allowed_token_ids"),
])
def test_values_the_sampler_cannot_hold_are_refused_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as e:
        check_params(SamplingParams(**fields), LIMITS)
    assert e.value.param == param


def test_values_within_the_sampler_pass() -> None:
    ok = SamplingParams(top_k=2**31 - 1, stop_token_ids=tuple(range(100, 114)), min_tokens=1, n=8,
                        temperature=3e38)
    assert check_params(ok, LIMITS).stop_token_ids == ok.stop_token_ids
    # ignore_eos frees the eos slots for stop ids
    many = SamplingParams(stop_token_ids=tuple(range(100, 116)), min_tokens=1, ignore_eos=True)
    check_params(many, LIMITS)
    # an allowed set with a token beyond the held-back ones can always sample
    check_params(SamplingParams(allowed_token_ids=[1, 2, 1023], min_tokens=1, logit_bias={"0": 5}), LIMITS)
    check_params(SamplingParams(allowed_token_ids=[1, 2], min_tokens=1, ignore_eos=True), LIMITS)


def test_meaning_preserving_normalisations() -> None:
    # top_k past the vocabulary keeps every token: off
    assert check_params(SamplingParams(top_k=5000), LIMITS).top_k == 0
    # a top_p that float32 rounds to 0 would keep nothing: it keeps the most likely token
    assert check_params(SamplingParams(top_p=1e-300), LIMITS).top_p == F32_TINY
    assert check_params(SamplingParams(top_p=0.5), LIMITS).top_p == 0.5


@pytest.mark.parametrize(("stop", "ok"), [
    (["x"] * MAX_STOP_STRINGS, True),
    (["x"] * (MAX_STOP_STRINGS + 1), False),
    (["y" * MAX_STOP_CHARS], True),
    (["y" * (MAX_STOP_CHARS - 1), "zz"], False),
])
def test_stop_strings_are_bounded(stop: list[str], ok: bool) -> None:
    if ok:
        SamplingParams(stop=tuple(stop))
    else:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(stop=tuple(stop))
        assert e.value.param == "stop"


def test_preview_cuts_long_and_deep_values() -> None:
    assert preview("abc") == "'abc'"
    assert preview({"a": [1, 2]}) == "{'a': [1, 2]}"
    long = preview("x" * 10_000_000)
    assert len(long) <= 90 and long.endswith("...")
    deep = preview(nested(100_000))  # repr would raise RecursionError
    assert deep.startswith("[[[[") and len(deep) <= 90
    wide = preview(list(range(1_000_000)))
    assert len(wide) <= 90


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "seed", "user", "top_k", "stop",
                                   "stop_token_ids", "n", "stream", "priority"])
def test_deeply_nested_fields_are_400_not_recursion(field: str) -> None:
    body = {"prompt": "x", field: nested(990)}
    with pytest.raises((ProtocolError, SamplingParamsError)) as e:
        parse_completion_request(body)
    assert e.value.param == field
    assert len(str(e.value)) < 300


def test_deeply_nested_prompt_is_400() -> None:
    for depth in (3, 50, 990):
        with pytest.raises(ProtocolError) as e:
            parse_prompts(nested(depth))
        assert e.value.param == "prompt"
    assert parse_prompts([[5, 6]]) == ((5, 6),)
    assert parse_prompts(["text"]) == ("text",)


def test_token_prompt_longer_than_the_context_is_refused_before_it_is_read() -> None:
    with pytest.raises(ProtocolError, match="maximum context length is 256"):
        parse_prompts([0] * 256 + ["not even an int"], max_tokens=256)
    with pytest.raises(ProtocolError, match="maximum context length is 256"):
        parse_prompts([[1, 2], [0] * 256], max_tokens=256)  # each prompt of a batch is bounded
    assert parse_prompts([3] * 255, max_tokens=256) == ((3,) * 255,)


def test_error_messages_quote_values_cut_short() -> None:
    with pytest.raises(ProtocolError) as e:
        get_int({"max_tokens": "9" * 1_000_000}, "max_tokens")
    assert len(str(e.value)) < 200
