"""The sampler on numpy: the reference every other backend's sampler is checked against.

Functions have the signatures of the sampling ops in `vt.kernels.base.Backend` (minus `self`).
The rules, stated exactly so another implementation can match them bit for bit where possible:

- All math is float32. `l = logits / temperature` per row (float32 division).
- Greedy rows (temperature < 1e-5): argmax of the raw logits, ties to the lowest id.
- top_k (k >= 1 and k < V, else off): keep every token with `l >= v_k`, where v_k is the k-th largest
  value of l counting duplicates. Ties at v_k are all kept, so more than k tokens may survive.
- Probabilities for top_p and min_p: `e = exp(l - max l)` over the tokens still kept (0 elsewhere),
  `p = e / sum(e)`; i.e. renormalised after top_k, as vLLM does.
- top_p (< 1, else off): order the kept tokens by (p descending, id ascending); keep a token when the
  float32 sum of p over the tokens strictly before it in that order is < top_p. The first token has
  mass 0 before it, so it is always kept.
- min_p (> 0, else off): keep tokens with `e >= min_p` (equal to `p >= min_p * max p`, but free of the
  normaliser so it does not depend on summation order). The top token always survives.
- Choice: argmax over kept tokens of `l + gumbel(seed, offset, token)`, ties to the lowest id, with
  the counter-based Gumbel noise of base.py. `u` is computed in float32 as
  `(float32(x >> 40) + 0.5) * 2**-24`; for the largest value of x >> 40 that rounds to 1.0, so u is
  then clamped to the largest float32 below 1 (0x3F7FFFFF), keeping the noise finite.
  Noise is drawn for every token id of the vocabulary, independent of the batch and the filters,
  so a seeded request gets the same token whatever batch it runs in.
- No token allowed (every logit of the row is -inf after biases, bans and masks): the row samples
  -1, never a token the request's constraints exclude; record_sampled skips it, and the engine
  ends that request with its own error.
Exact float ties at filter boundaries may round differently on another backend; tests avoid them.
"""

from __future__ import annotations

import numpy as np

GREEDY_EPS = 1e-5
_C_SEED = np.uint64(0x9E3779B97F4A7C15)
_C_OFFSET = np.uint64(0xBF58476D1CE4E5B9)
_C_TOKEN = np.uint64(0x94D049BB133111EB)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_U_MAX = np.frombuffer(np.uint32(0x3F7FFFFF).tobytes(), dtype=np.float32)[0]


def gumbel_noise(seeds: np.ndarray, offsets: np.ndarray, vocab: int) -> np.ndarray:
    """Counter-based Gumbel noise f32[B, vocab] for seeds (u64 bits in i64[B]) and offsets i32[B]."""
    seeds_u = np.ascontiguousarray(seeds, dtype=np.int64).view(np.uint64)
    offs_u = np.asarray(offsets, dtype=np.int64).astype(np.uint64)
    tok = np.arange(vocab, dtype=np.uint64)
    # uint64 arithmetic wraps mod 2**64 by design
    with np.errstate(over="ignore"):
        x = (seeds_u * _C_SEED + offs_u * _C_OFFSET)[:, None] + tok[None, :] * _C_TOKEN
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    u = ((x >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    np.minimum(u, _U_MAX, out=u)
    return -np.log(-np.log(u))


def _kept_mask(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The allowed set of one row of logits / T (module docstring rules)."""
    vocab = scaled.shape[0]
    keep = ~np.isnan(scaled) & (scaled > -np.inf)  # banned (-inf) tokens are never allowed
    if 1 <= top_k < vocab:
        kth = np.partition(scaled, vocab - top_k)[vocab - top_k]
        keep &= scaled >= kth
    if top_p >= 1.0 and min_p <= 0.0:
        return keep
    if not keep.any():
        return keep
    m = np.max(scaled[keep])
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(keep, np.exp(scaled - m), np.float32(0)).astype(np.float32)
    if top_p < 1.0:
        p = e / np.sum(e, dtype=np.float32)
        order = np.argsort(-p, kind="stable")  # p desc, id asc
        ps = p[order]
        # exclusive prefix as a running float32 sum (cumsum - ps would round differently)
        before = np.concatenate(([np.float32(0)], np.cumsum(ps, dtype=np.float32)[:-1]))
        keep_sorted = before < np.float32(top_p)
        keep_p = np.zeros(vocab, dtype=bool)
        keep_p[order] = keep_sorted
        keep &= keep_p
    if min_p > 0.0:
        keep &= e >= np.float32(min_p)
    return keep


def sample(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           min_p: np.ndarray, seeds: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """-> i32[B]; see the module docstring for the exact rules."""
    logits = np.asarray(logits, dtype=np.float32)
    batch, vocab = logits.shape
    temperature = np.asarray(temperature, dtype=np.float32)
    out = np.argmax(logits, axis=1).astype(np.int32)  # greedy rows are done
    out[logits[np.arange(batch), out] == -np.inf] = -1  # ... but a row whose every token is excluded
    rand = np.nonzero(temperature >= GREEDY_EPS)[0]
    if rand.size == 0:
        return out
    top_k = np.asarray(top_k)
    top_p = np.asarray(top_p, dtype=np.float32)
    min_p = np.asarray(min_p, dtype=np.float32)
    scaled = logits[rand] / temperature[rand, None]
    noise = gumbel_noise(np.asarray(seeds)[rand], np.asarray(offsets)[rand], vocab)
    score = scaled + noise
    for j, b in enumerate(rand):
        keep = _kept_mask(scaled[j], int(top_k[b]), float(top_p[b]), float(min_p[b]))
        score[j, ~keep] = -np.inf
    best = np.argmax(score, axis=1)
    out[rand] = np.where(score[np.arange(rand.size), best] == -np.inf, -1, best)
    return out


def log_softmax_topk(logits: np.ndarray, ids: np.ndarray,
                     k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (logprob of ids f32[B], top ids i32[B, k], top logprobs f32[B, k]); desc, ties to lower id."""
    logits = np.asarray(logits, dtype=np.float32)
    batch, vocab = logits.shape
    m = np.max(logits, axis=1, keepdims=True)
    lse = m + np.log(np.sum(np.exp(logits - m), axis=1, keepdims=True, dtype=np.float32))
    lp = (logits - lse).astype(np.float32)
    ids = np.asarray(ids, dtype=np.int64)
    valid = (ids >= 0) & (ids < vocab)  # -1: the row had no token to sample
    chosen = np.where(valid, lp[np.arange(batch), np.where(valid, ids, 0)], -np.inf).astype(np.float32)
    k = min(int(k), vocab)
    top_ids = np.zeros((batch, max(k, 0)), dtype=np.int32)
    top_lp = np.zeros((batch, max(k, 0)), dtype=np.float32)
    if k <= 0:
        return chosen, top_ids, top_lp
    for b in range(batch):
        row = lp[b]
        thr = np.partition(row, vocab - k)[vocab - k]
        cand = np.nonzero(row >= thr)[0]
        # lexsort: last key is primary -> value desc, then id asc
        order = cand[np.lexsort((cand, -row[cand]))][:k]
        top_ids[b] = order
        top_lp[b] = row[order]
    return chosen, top_ids, top_lp


def penalize(logits: np.ndarray, rows: np.ndarray, out_counts: np.ndarray, prompt_mask: np.ndarray,
             presence: np.ndarray, frequency: np.ndarray, repetition: np.ndarray) -> None:
    """In place, vLLM's semantics: repetition on prompt-or-output tokens, then frequency/presence
    on output counts."""
    rows = np.asarray(rows)
    valid = np.nonzero(rows >= 0)[0]
    if valid.size == 0:
        return
    r = rows[valid]
    lg = logits[valid].astype(np.float32)
    counts = out_counts[r]
    in_out = counts > 0
    rep = np.asarray(repetition, dtype=np.float32)[valid, None]
    seen = in_out | (prompt_mask[r] > 0)
    penalised = np.where(lg > 0, lg / rep, lg * rep)
    lg = np.where(seen & (rep != 1), penalised, lg)
    freq = np.asarray(frequency, dtype=np.float32)[valid, None]
    pres = np.asarray(presence, dtype=np.float32)[valid, None]
    lg = lg - (freq * counts.astype(np.float32) + pres * in_out.astype(np.float32))
    logits[valid] = lg


def ban_tokens(logits: np.ndarray, ban: np.ndarray) -> None:
    """In place: logits[b, ban[b, j]] = -inf for every ban[b, j] >= 0."""
    ban = np.asarray(ban)
    b_idx, j_idx = np.nonzero(ban >= 0)
    logits[b_idx, ban[b_idx, j_idx]] = -np.inf


def bias_logits(logits: np.ndarray, sel: np.ndarray, tokens: np.ndarray, biases: np.ndarray) -> None:
    """In place: for each (b, r, n, e) in sel, logits[b, tokens[r, :n]] += biases[r, :n]; with
    e != 0 every token of row b not in tokens[r, :n] becomes -inf (see Backend.bias_logits)."""
    for b, r, n, e in np.asarray(sel).tolist():
        if not 0 <= b < logits.shape[0]:
            continue
        toks = np.asarray(tokens[r, :n], dtype=np.intp)
        kept = logits[b, toks] + np.asarray(biases[r, :n], dtype=np.float32)
        if e:
            logits[b] = -np.inf
        logits[b, toks] = kept


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """In place: for every m with rows[m] >= 0, logits[rows[m], t] = -inf where bit t % 32 of word
    bitmask[m, t // 32] is 0 (tokens past 32 * W count as cleared). bitmask i32[M, W] holds
    llguidance's layout (bit j of word w allows token 32 w + j); rows i32[M]."""
    rows = np.asarray(rows)
    valid = np.nonzero(rows >= 0)[0]
    if valid.size == 0:
        return
    vocab = logits.shape[1]
    words = np.ascontiguousarray(np.asarray(bitmask, dtype=np.int32)[valid])
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    target = rows[valid]
    logits[target] = np.where(bits, logits[target], np.float32(-np.inf))


def record_sampled(last_tokens: np.ndarray, out_counts: np.ndarray, rows: np.ndarray,
                   ids: np.ndarray) -> None:
    """In place: last_tokens[rows[b]] = ids[b]; out_counts[rows[b], ids[b]] += 1 where rows[b] >= 0
    and ids[b] >= 0 (a row that sampled no token keeps its last token: a decode already launched
    behind it reads a valid id, and its output is dropped)."""
    rows = np.asarray(rows)
    ids = np.asarray(ids)
    valid = (rows >= 0) & (ids >= 0)
    r, t = rows[valid], ids[valid]
    last_tokens[r] = t
    np.add.at(out_counts, (r, t), 1)
