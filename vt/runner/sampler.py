"""The sampler's device state and its passes over a step's logits.

Per-request sampler state lives on the device in one row per running request: the last sampled
token, output token counts, the prompt-token mask and the logit-bias line. A decode whose input
token is not yet on the host reads it from last_tokens[row], which the previous step's sampler
wrote (stream order makes that safe); penalties see every earlier token the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vt.kernels.base import Backend
from vt.runner.buffers import MAX_BANNED, SampledBuffers, SamplerRow, SlotBuffers
from vt.sampling_params import MAX_LOGIT_ENTRIES
from vt.sched.output import NewRequestData


class StepSampler:
    """Biases, penalties, bans and masks on a step's logits, then the draw; each reads the
    step's sampler inputs from its slot's buffers (uploaded by staging.upload_inputs)."""

    def __init__(self, ops: Backend, num_rows: int, vocab: int, mask_words: int) -> None:
        self.ops, self.num_rows, self.mask_words = ops, num_rows, mask_words
        self.last_tokens = ops.zeros((num_rows,), "i32")
        self.out_counts = ops.zeros((num_rows, vocab), "i32")
        self.prompt_mask = ops.zeros((num_rows, vocab), "u8")
        # logit_bias / allowed_token_ids by sampler row, written at admission: ids ascending and
        # their biases (a request holds at most MAX_LOGIT_ENTRIES, checked by SamplingParams)
        self.bias_tokens = ops.zeros((num_rows, MAX_LOGIT_ENTRIES), "i32")
        self.bias_values = ops.zeros((num_rows, MAX_LOGIT_ENTRIES), "f32")

    # ---- rows set up at admission (device work on the current slot) ----------------------------
    def init_bias_row(self, row: SamplerRow, tokens: tuple[int, ...], biases: tuple[float, ...]) -> None:
        """Write a row's logit_bias / allowed_token_ids line (admissions of such requests only,
        through from_host like the penalty rows)."""
        n = len(tokens)
        if n:
            ops = self.ops
            self.bias_tokens[row.index, :n] = ops.from_host(np.asarray(tokens, np.int32), "i32")
            self.bias_values[row.index, :n] = ops.from_host(np.asarray(biases, np.float32), "f32")

    def init_penalty_row(self, row: SamplerRow, new: NewRequestData) -> None:
        """Rebuild a row's prompt mask and output counts. Only admissions of requests with
        penalties come here; their small index uploads go through from_host, which allocates and
        waits for the stream: a known cost of those steps only."""
        ops = self.ops
        self.out_counts[row.index].fill(0)
        self.prompt_mask[row.index].fill(0)
        if new.prompt_token_ids:
            ids = ops.from_host(np.asarray(sorted(set(new.prompt_token_ids)), np.int32), "i32")
            self.prompt_mask[row.index, ids] = 1
        if new.output_token_ids:
            n = len(new.output_token_ids)
            scratch = ops.zeros((self.num_rows,), "i32")
            ops.record_sampled(scratch, self.out_counts,
                               ops.from_host(np.full(n, row.index, np.int32), "i32"),
                               ops.from_host(np.asarray(new.output_token_ids, np.int32), "i32"))

    # ---- passes -----------------------------------------------------------------------------
    def sample(self, buf: SlotBuffers, logits: Any, num_seqs: int, logprobs_k: int, any_penalty: bool,
               any_ban: bool, num_masks: int = 0, num_biased: int = 0) -> None:
        """Process the logits in place and draw, recording the tokens of buf's record_rows into
        the rows' state and copying ids (and logprobs) to buf.out."""
        ops = self.ops
        rows = buf.sample_rows[1][:num_seqs]
        if num_biased:  # first, as vLLM's sampler: penalties and bans apply to the biased logits
            sel = buf.bias_sel
            ops.copy_h2d(sel[1][: 4 * num_biased], sel[0][: 4 * num_biased])
            ops.bias_logits(logits, sel[1][: 4 * num_biased].reshape(num_biased, 4), self.bias_tokens,
                            self.bias_values)
        if any_penalty:
            ops.penalize(logits, rows, self.out_counts, self.prompt_mask, buf.presence[1][:num_seqs],
                         buf.frequency[1][:num_seqs], buf.repetition[1][:num_seqs])
        if any_ban:
            ops.ban_tokens(logits, buf.ban[1][: num_seqs * MAX_BANNED].reshape(num_seqs, MAX_BANNED))
        self.apply_masks(buf, logits, num_masks)
        self.draw(buf, logits, num_seqs, logprobs_k, buf.record_rows[1][:num_seqs], buf.out)

    def sample_masked(self, buf: SlotBuffers, logits: Any, num_seqs: int, logprobs_k: int,
                      num_masks: int) -> None:
        """A masked step's second pass: its guided rows' masks on the logits the first pass left
        (penalties, bans and biases are in them already), then the draw again, recording only the
        guided rows (masked_record_rows) and writing to buf.masked_out. Every row is drawn, as
        the per-row draws do not depend on the batch; the free rows' second draws are unused."""
        self.apply_masks(buf, logits, num_masks)
        record = buf.masked_record_rows
        self.ops.copy_h2d(record[1][:num_seqs], record[0][:num_seqs])
        self.draw(buf, logits, num_seqs, logprobs_k, record[1][:num_seqs], buf.masked_out)

    def apply_masks(self, buf: SlotBuffers, logits: Any, num_masks: int) -> None:
        """Upload the step's staged bitmasks and apply them to their rows' logits, in place (no
        arena memory: it may run between captured parts)."""
        if not num_masks:
            return
        ops, words = self.ops, num_masks * self.mask_words
        ops.copy_h2d(buf.bitmask[1][:words], buf.bitmask[0][:words])
        ops.copy_h2d(buf.mask_rows[1][:num_masks], buf.mask_rows[0][:num_masks])
        ops.apply_token_bitmask(logits, buf.bitmask[1][:words].reshape(num_masks, self.mask_words),
                                buf.mask_rows[1][:num_masks])

    def draw(self, buf: SlotBuffers, logits: Any, num_seqs: int, logprobs_k: int, record: Any,
             out: SampledBuffers) -> None:
        """Sample the (processed) logits, record the tokens of the sampler rows `record` (-1:
        not this pass's), and copy ids and logprobs to `out`."""
        ops, n = self.ops, num_seqs
        ids = ops.sample(logits, buf.temperature[1][:n], buf.top_k[1][:n], buf.top_p[1][:n],
                         buf.min_p[1][:n], buf.seeds[1][:n], buf.offsets[1][:n])
        ops.record_sampled(self.last_tokens, self.out_counts, record, ids)
        ops.copy_d2h(out.ids[:n], ids)
        if k := logprobs_k:
            lp, top_ids, top_lp = ops.log_softmax_topk(logits, ids, k)
            ops.copy_d2h(out.logprob[:n], lp)
            ops.copy_d2h(out.top_ids[: n * k].reshape(n, k), top_ids)
            ops.copy_d2h(out.top_lp[: n * k].reshape(n, k), top_lp)
