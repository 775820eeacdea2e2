"""SamplingParams validation and the numpy sampler (the reference for every backend)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vt.kernels import numpy_sampling as ns
from vt.sampling_params import SamplingParams, SamplingParamsError

# ---- SamplingParams ------------------------------------------------------------------------

BAD = [
    ("n", 0), ("n", 129), ("n", 1.0), ("n", True),
    ("max_tokens", 0), ("max_tokens", "1"), ("max_tokens", 2.0), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "1"), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", 1.5), ("top_k", False),
    ("min_p", -0.01), ("min_p", 1.5),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0), ("seed", "7"),
    ("stop", ""), ("stop", ("a", "")), ("stop", (1,)), ("stop", 5),
    ("stop_token_ids", (-1,)), ("stop_token_ids", ("1",)), ("stop_token_ids", (True,)), ("stop_token_ids", 3),
    ("min_tokens", -1), ("min_tokens", 1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3),
    ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")), ("repetition_penalty", -1),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("include_stop_str_in_output", None),
    ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"5": 100.5}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {5: "1"}), ("logit_bias", [3]), ("logit_bias", "a"),
    ("logit_bias", {i: 1 for i in range(4097)}),
    ("allowed_token_ids", []), ("allowed_token_ids", [1, -1]), ("allowed_token_ids", ["1"]),
    ("allowed_token_ids", 3), ("allowed_token_ids", list(range(4097))),
]


@pytest.mark.parametrize("field,value", BAD)
def test_bad_value_names_the_param(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert e.value.param == "min_tokens"
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k) == (1, 16, 1.0, 1.0, 0)
    assert not p.greedy
    q = SamplingParams(stop="###", stop_token_ids=[3, 4], temperature=0, top_p=1, seed=2**64 - 1,
                       top_k=-1, logprobs=20, max_tokens=None)
    assert q.stop == ("###",) and q.stop_token_ids == (3, 4)
    assert isinstance(q.temperature, float) and q.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=1e-6).greedy
    with pytest.raises(AttributeError):
        q.temperature = 1.0  # frozen


def test_logit_entries_merge_bias_into_the_allowed_set():
    """JSON keys are strings: they become ids, sorted; allowed_token_ids makes the line exclusive
    and keeps only the biases of allowed ids (a bias on a masked token cannot matter)."""
    p = SamplingParams(logit_bias={"9": -2.5, "3": 100, 7: 0.5})
    assert p.logit_bias == ((3, 100.0), (7, 0.5), (9, -2.5))
    assert p.logit_entries() == ((3, 7, 9), (100.0, 0.5, -2.5), False)
    q = SamplingParams(allowed_token_ids=[9, 2, 9, 5], logit_bias={"5": 1, "4": 50})
    assert q.allowed_token_ids == (2, 5, 9)
    assert q.logit_entries() == ((2, 5, 9), (0.0, 1.0, 0.0), True)
    assert SamplingParams().logit_entries() is None
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={"3": 1}) == SamplingParams(logit_bias=[(3, 1.0)])


def test_bias_logits_adds_biases_and_masks_what_is_not_allowed():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    tokens = np.zeros((3, 8), np.int32)
    biases = np.zeros((3, 8), np.float32)
    tokens[0, :2], biases[0, :2] = [4, 49], [10.0, -3.0]
    tokens[1, :3], biases[1, :3] = [1, 2, 30], [0.0, 5.0, 0.0]
    sel = np.array([[3, 0, 2, 0], [0, 1, 3, 1], [-1, 0, 2, 1]], np.int32)
    out = logits.copy()
    ns.bias_logits(out, sel, tokens, biases)
    expect = logits.copy()
    expect[3, 4] += 10.0
    expect[3, 49] -= 3.0
    expect[0] = -np.inf
    expect[0, [1, 2, 30]] = logits[0, [1, 2, 30]] + [0.0, 5.0, 0.0]
    np.testing.assert_array_equal(out, expect)
    assert _support(out[0], draws=300)[0] <= {1, 2, 30}


# ---- sampler helpers -----------------------------------------------------------------------

def _run(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, offsets=None):
    logits = np.atleast_2d(np.asarray(logits, dtype=np.float32))
    b = logits.shape[0]
    full = lambda v, dt: np.broadcast_to(np.asarray(v, dtype=dt), (b,)).copy()
    seeds = np.zeros(b, np.int64) if seeds is None else np.asarray(seeds, np.int64)
    offsets = np.zeros(b, np.int32) if offsets is None else np.asarray(offsets, np.int32)
    return ns.sample(logits, full(temperature, np.float32), full(top_k, np.int32),
                     full(top_p, np.float32), full(min_p, np.float32), seeds, offsets)


def _support(logits, draws=600, **kw):
    """Set of tokens seen over many offsets of one row (the sampler's support)."""
    row = np.asarray(logits, np.float32)
    batch = np.tile(row, (draws, 1))
    out = _run(batch, seeds=np.full(draws, 7), offsets=np.arange(draws), **kw)
    return set(out.tolist()), out


# ---- sample ----------------------------------------------------------------------------------

def test_greedy_picks_argmax_ties_to_lowest_id():
    logits = [[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]]
    out = _run(logits, temperature=0.0, seeds=[1, 2, 3], offsets=[4, 5, 6])
    assert out.tolist() == [1, 0, 2]
    assert out.dtype == np.int32


def test_top_k_keeps_exactly_k_and_ties_at_the_kth_value():
    logits = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 0.5, 1.5, 2.5], np.float32)
    seen, _ = _support(logits, top_k=3, temperature=5.0)
    assert seen == {3, 4, 7}   # values 3.0, 4.0, 2.5
    tied = np.array([0.0, 2.0, 1.0, 2.0, 3.0, 2.0], np.float32)  # 3rd largest value 2.0 is tied
    seen, _ = _support(tied, top_k=3, temperature=5.0)
    assert seen == {1, 3, 4, 5}
    seen, _ = _support(logits, top_k=100, temperature=5.0)
    assert seen == set(range(8))


def test_top_p_keeps_the_prefix_with_mass_before_below_p():
    probs = np.array([0.05, 0.4, 0.3, 0.2, 0.05], np.float32)
    logits = np.log(probs)
    # order 1 (0.4), 2 (0.3), 3 (0.2), 0 (0.05), 4 (0.05); mass before: 0, .4, .7, .9, .95
    assert _support(logits, top_p=0.5)[0] == {1, 2}
    assert _support(logits, top_p=0.75)[0] == {1, 2, 3}
    assert _support(logits, top_p=0.92)[0] == {0, 1, 2, 3}   # tie 0 vs 4 broken by id
    assert _support(logits, top_p=0.01)[0] == {1}            # the top token always survives


def test_top_p_applies_after_top_k_renormalisation():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    # top_k=2 -> renormalised 4/7, 3/7; top_p 0.55: mass before id 1 is 0.571 >= 0.55 -> dropped
    assert _support(logits, top_k=2, top_p=0.55)[0] == {0}
    assert _support(logits, top_k=2, top_p=0.6)[0] == {0, 1}


def test_min_p_keeps_tokens_with_probability_at_least_min_p_times_max():
    probs = np.array([0.5, 0.26, 0.24, 0.0001], np.float32)
    logits = np.log(probs)
    assert _support(logits, min_p=0.5)[0] == {0, 1}
    assert _support(logits, min_p=0.47)[0] == {0, 1, 2}
    assert _support(logits, min_p=1.0)[0] == {0}


def test_banned_tokens_are_never_sampled():
    logits = np.zeros(6, np.float32)
    logits[[1, 4]] = -np.inf
    assert _support(logits, draws=300)[0] == {0, 2, 3, 5}


def test_seeded_draw_is_independent_of_batch_composition_and_order():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32)
    seeds = np.array([11, -(2**63) + 5, 3, -1, 99], np.int64)  # negative: u64 values >= 2**63
    offsets = np.array([0, 7, 3, 1000, 2], np.int32)
    temps = np.array([0.7, 1.0, 1.3, 0.9, 2.0], np.float32)
    kw = dict(top_k=np.array([0, 10, 0, 5, 0], np.int32), top_p=np.array([1, 0.9, 0.8, 1, 1], np.float32),
              min_p=np.array([0, 0, 0.05, 0, 0], np.float32))
    full = ns.sample(logits, temps, kw["top_k"], kw["top_p"], kw["min_p"], seeds, offsets)
    perm = np.array([3, 0, 4, 2, 1])
    shuffled = ns.sample(logits[perm], temps[perm], kw["top_k"][perm], kw["top_p"][perm],
                         kw["min_p"][perm], seeds[perm], offsets[perm])
    assert shuffled.tolist() == full[perm].tolist()
    for b in range(5):
        alone = ns.sample(logits[b:b + 1], temps[b:b + 1], kw["top_k"][b:b + 1], kw["top_p"][b:b + 1],
                          kw["min_p"][b:b + 1], seeds[b:b + 1], offsets[b:b + 1])
        assert alone[0] == full[b]


def test_different_offsets_and_seeds_draw_differently():
    logits = np.zeros(1000, np.float32)
    _, by_offset = _support(logits, draws=50)
    assert len(set(by_offset.tolist())) > 40
    batch = np.tile(logits, (50, 1))
    by_seed = _run(batch, seeds=np.arange(50), offsets=np.zeros(50))
    assert len(set(by_seed.tolist())) > 40


def test_empirical_distribution_matches_softmax():
    logits = np.array([1.0, 0.0, -1.0, 0.5, 2.0], np.float32)
    temperature = 0.8
    _, out = _support(logits, draws=20000, temperature=temperature)
    freq = np.bincount(out, minlength=5) / out.size
    expect = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
    assert np.max(np.abs(freq - expect)) < 0.02


def test_gumbel_noise_is_finite_and_follows_the_documented_hash():
    seeds = np.array([123, -5], np.int64)
    offsets = np.array([4, 9], np.int32)
    g = ns.gumbel_noise(seeds, offsets, 8)
    assert np.all(np.isfinite(g)) and g.dtype == np.float32
    # the rule written out with Python integers
    mask = 2**64 - 1
    s = (-5) & mask
    x = (s * 0x9E3779B97F4A7C15 + 9 * 0xBF58476D1CE4E5B9 + 3 * 0x94D049BB133111EB) & mask
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & mask
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    u = ((x >> 40) + 0.5) / 2**24
    assert g[1, 3] == pytest.approx(-math.log(-math.log(u)), rel=1e-5)


# ---- penalties, bans, records, logprobs ----------------------------------------------------

def test_penalize_matches_hand_computed_values():
    logits = np.array([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0], [4.0, 4.0, 4.0, 4.0]], np.float32)
    out_counts = np.zeros((4, 4), np.int32)
    out_counts[2] = [0, 2, 1, 0]   # row 2 (batch row 0): token 1 twice, token 2 once
    prompt_mask = np.zeros((4, 4), np.uint8)
    prompt_mask[2, 3] = 1
    out_counts[0] = [3, 0, 0, 0]
    rows = np.array([2, 0, -1], np.int32)
    presence = np.array([0.5, 0.0, 9.0], np.float32)
    frequency = np.array([0.25, 1.0, 9.0], np.float32)
    repetition = np.array([2.0, 1.0, 9.0], np.float32)
    ns.penalize(logits, rows, out_counts, prompt_mask, presence, frequency, repetition)
    expect0 = [2.0, -1.0 * 2 - (0.25 * 2 + 0.5), 0.5 / 2 - (0.25 + 0.5), 3.0 / 2]
    np.testing.assert_allclose(logits[0], expect0, rtol=1e-6)
    np.testing.assert_allclose(logits[1], [1.0 - 3.0, 1.0, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(logits[2], [4.0, 4.0, 4.0, 4.0])  # row -1 untouched


def test_ban_tokens_sets_minus_inf_only_where_asked():
    logits = np.zeros((2, 5), np.float32)
    ns.ban_tokens(logits, np.array([[1, 3, -1], [-1, -1, -1]], np.int32))
    assert np.isneginf(logits[0, [1, 3]]).all()
    assert np.isfinite(logits[0, [0, 2, 4]]).all() and np.isfinite(logits[1]).all()


def test_record_sampled_updates_last_token_and_counts():
    last = np.full(4, -7, np.int32)
    counts = np.zeros((4, 6), np.int32)
    ns.record_sampled(last, counts, np.array([2, -1, 0], np.int32), np.array([5, 1, 3], np.int32))
    ns.record_sampled(last, counts, np.array([2], np.int32), np.array([5], np.int32))
    assert last.tolist() == [3, -7, 5, -7]
    assert counts[2, 5] == 2 and counts[0, 3] == 1 and counts.sum() == 3


def test_log_softmax_topk_values_and_order():
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    chosen, top_ids, top_lp = ns.log_softmax_topk(logits, np.array([4, 2], np.int32), 3)
    ref = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(chosen, [ref[0, 4], ref[1, 2]], rtol=1e-6)
    assert top_ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    np.testing.assert_allclose(top_lp, [[ref[0, 1], ref[0, 2], ref[0, 4]], ref[1, :3]], rtol=1e-6)
    assert top_ids.dtype == np.int32 and top_lp.dtype == np.float32
    _, ids0, lp0 = ns.log_softmax_topk(logits, np.array([0, 0], np.int32), 0)
    assert ids0.shape == (2, 0) and lp0.shape == (2, 0)
