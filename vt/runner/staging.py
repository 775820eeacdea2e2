"""Staging: a ScheduledBatch into its slot's host buffers (token ids, positions, KV slots, block
tables, query starts, sequence lengths, last-token indices, sampler rows and parameters, bans,
biases, masks), and those buffers onto the device as a ForwardBatch.

Staging writes into the slot's preallocated (pinned) buffers only. Per-token and per-sequence
values go to Python lists first and into the buffers with one store per field: per-element numpy
stores cost more than the rest of a step's host work at a few hundred sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vt.kernels.base import Backend
from vt.kernels.cascade_plan import common_prefix_blocks
from vt.model.batch import ForwardBatch
from vt.runner.buffers import MAX_BANNED, ROW_PARAM_FIELDS, HostDevice, SamplerRow, SlotBuffers
from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq

# eos_for(request_id): the token ids min_tokens keeps banned for that request
EosFor = Callable[[str], tuple[int, ...]]


class SamplerRows:
    """One sampler row per running request, taken at admission and freed at release, with the
    host tables staging gathers from by row."""

    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.by_request: dict[str, SamplerRow] = {}
        self.free = list(range(num_rows - 1, -1, -1))
        # Sampling parameters by sampler row, set at admission: a step gathers its rows' values
        # with one indexed copy per field instead of per-sequence scalar stores.
        self.params = {name: np.zeros(num_rows, dt) for name, dt in ROW_PARAM_FIELDS}
        # Block table lines by sampler row, kept across steps: a running request's blocks only
        # grow, so a step writes the new entries and gathers its rows' lines in one take.
        self.blocks = np.zeros((num_rows, max_blocks), np.int32)

    def get(self, request_id: str) -> SamplerRow | None:
        return self.by_request.get(request_id)

    def release(self, request_id: str) -> None:
        row = self.by_request.pop(request_id, None)
        if row is not None:
            self.free.append(row.index)

    def admit(self, request_id: str, new: NewRequestData, eos_ids: tuple[int, ...]) -> SamplerRow:
        self.release(request_id)
        if not self.free:
            raise RuntimeError("no free sampler row (more running requests than max_num_seqs)")
        p = new.params
        penalized = (p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0)
        row = SamplerRow(self.free.pop(), p, eos_ids, penalized, p.structured is not None,
                         bias=p.logit_entries())
        self.by_request[request_id] = row
        self.blocks[row.index].fill(0)
        values = (p.temperature, p.top_k if p.top_k > 0 else 0, p.top_p, p.min_p,
                  np.uint64(p.seed if p.seed is not None else 0).astype(np.int64), p.presence_penalty,
                  p.frequency_penalty, p.repetition_penalty)
        for (name, _), value in zip(ROW_PARAM_FIELDS, values, strict=True):
            self.params[name][row.index] = value
        return row

    def update_blocks(self, row: SamplerRow, blocks: tuple[int, ...]) -> None:
        """Bring the row's block table line up to the request's blocks (which changed)."""
        num_blocks = len(blocks)
        line = self.blocks[row.index]
        if num_blocks > row.num_blocks:  # the usual change: blocks appended
            line[row.num_blocks: num_blocks] = blocks[row.num_blocks:]
        else:
            line.fill(0)
            line[:num_blocks] = blocks
        row.num_blocks = num_blocks


PenaltyInit = tuple[SamplerRow, NewRequestData]
BiasInit = tuple[SamplerRow, tuple[int, ...], tuple[float, ...]]


@dataclass(frozen=True)
class StagedBatch:
    """A step's batch as staged into its slot's host buffers: the sizes its forward runs at, the
    sampler's switches, and which rows each sampler pass samples."""

    num_tokens: int
    num_seqs: int
    max_blocks: int                      # block-table stride of this step
    num_decodes: int                     # leading sequences with one token each
    cascade_blocks: int                  # leading blocks all of them share (cascade attention), or 0
    max_query_len: int
    max_seq_len: int
    decode_only: bool                    # every sequence one token, no admission
    penalty_inits: list[PenaltyInit]     # admissions whose penalty rows are set up on the device
    bias_inits: tuple[BiasInit, ...]     # admissions that bias logits: (row, tokens, biases)
    sampled: list[tuple[int, str]]       # (batch row, request id) of sampling sequences
    logprobs_k: int
    any_penalty: bool
    any_ban: bool
    num_biased: int                      # rows whose logits get a bias line (bias_sel entries)
    num_masks: int                       # guided rows: bitmask rows staged for the sampler
    mask_request_ids: tuple[str, ...]    # their request ids, in bitmask row order
    # A masked step: its guided rows' masks come after the previous step's tokens, so its
    # second sampler pass samples and records them (masked_rows) once they are in.
    deferred: bool
    masked_rows: frozenset[int]          # batch rows of the second pass (empty unless deferred)
    masked_owners: tuple[tuple[int, str, SamplerRow], ...]  # (batch row, request id, row) of those


@dataclass(frozen=True)
class _BatchLists:
    """A batch's per-token and per-sequence values, gathered in one pass over its sequences."""

    input_ids: list[int]
    src_rows: list[int]                  # sampler row whose last token is the input; -1: known
    positions: list[int]
    slot_mapping: list[int]
    query_ends: list[int]                # each sequence's end row (its next one's start)
    seq_lens: list[int]
    row_index: list[int]
    offsets: list[int]                   # output index sampled (the sampler's rng offset)
    sample_rows: list[int]               # sampler row of each sequence, -1 where it samples not
    biased: list[int]                    # (batch row, table row, entries, exclusive) per biased row
    mask_batch_rows: list[int]           # batch rows of guided sequences
    penalty_inits: list[PenaltyInit]
    bias_inits: list[BiasInit]
    sampled: list[tuple[int, str]]
    mask_request_ids: list[str]
    masked_owners: list[tuple[int, str, SamplerRow]]
    decode_only: bool
    logprobs_k: int
    any_penalty: bool
    any_ban: bool
    guided_input_in_flight: bool         # a guided row's input is the previous step's token


def decodes_first(seqs: tuple[ScheduledSeq, ...]) -> tuple[tuple[ScheduledSeq, ...], int]:
    """The batch's sequences with the single-token ones first, and how many those are: attention
    then runs them on decode tiles in one launch and the longer ones in another. Rows are staged,
    sampled and collected in this order."""
    longer = [s for s in seqs if s.num_tokens != 1]
    if longer and len(longer) < len(seqs):
        seqs = tuple([s for s in seqs if s.num_tokens == 1] + longer)
    return seqs, len(seqs) - len(longer)


def stage_batch(buf: SlotBuffers, batch: ScheduledBatch, rows: SamplerRows, block_size: int,
                eos_for: EosFor, defer_masks: bool, cascade: bool = False) -> StagedBatch:
    """Admit the batch's new requests to sampler rows and write the step into buf's host
    halves. defer_masks: a step with guided rows samples them in a second pass (a masked step)
    even where their masks could be filled now. cascade: look for blocks that every decode
    shares (cascade_plan.common_prefix_blocks)."""
    seqs, num_decodes = decodes_first(batch.seqs)
    num_seqs = len(seqs)
    max_blocks = max(len(s.block_ids) for s in seqs)
    ban_host = buf.ban[0][: num_seqs * MAX_BANNED].reshape(num_seqs, MAX_BANNED)
    ban_host.fill(-1)
    lists = _walk_sequences(seqs, rows, block_size, eos_for, ban_host)
    num_tokens = _write_token_inputs(buf, lists)
    deferred = bool(lists.mask_batch_rows) and (defer_masks or lists.guided_input_in_flight)
    _write_sampler_rows(buf, lists, deferred)
    row_index = np.asarray(lists.row_index, dtype=np.intp)
    block_table_host = buf.block_tables[0][: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    np.take(rows.blocks[:, :max_blocks], row_index, axis=0, out=block_table_host)
    for name, _ in ROW_PARAM_FIELDS:
        np.take(rows.params[name], row_index, out=getattr(buf, name)[0][:num_seqs])
    num_masks = len(lists.mask_batch_rows)
    cascade_blocks = (common_prefix_blocks(block_table_host[:num_decodes],
                                           np.asarray(lists.seq_lens[:num_decodes]), block_size)
                      if cascade and num_decodes else 0)
    return StagedBatch(
        num_tokens=num_tokens, num_seqs=num_seqs, max_blocks=max_blocks, num_decodes=num_decodes,
        cascade_blocks=cascade_blocks,
        max_query_len=max(s.num_tokens for s in seqs),
        max_seq_len=max(s.start_pos + s.num_tokens for s in seqs),
        decode_only=lists.decode_only, penalty_inits=lists.penalty_inits,
        bias_inits=tuple(lists.bias_inits), sampled=lists.sampled, logprobs_k=lists.logprobs_k,
        any_penalty=lists.any_penalty, any_ban=lists.any_ban, num_biased=len(lists.biased) // 4,
        num_masks=num_masks, mask_request_ids=tuple(lists.mask_request_ids), deferred=deferred,
        masked_rows=frozenset(lists.mask_batch_rows) if deferred else frozenset(),
        masked_owners=tuple(lists.masked_owners) if deferred else ())


def _walk_sequences(seqs: tuple[ScheduledSeq, ...], rows: SamplerRows, block_size: int,
                    eos_for: EosFor, ban_host: np.ndarray) -> _BatchLists:
    """One pass over the sequences: admissions, block lines, per-token and per-sequence values
    (the bans straight into ban_host)."""
    bs = block_size
    input_ids: list[int] = []
    src_rows: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_ends: list[int] = []
    seq_lens: list[int] = []
    row_index: list[int] = []
    offsets: list[int] = []
    sample_rows: list[int] = []
    biased: list[int] = []
    mask_batch_rows: list[int] = []
    penalty_inits: list[PenaltyInit] = []
    bias_inits: list[BiasInit] = []
    sampled: list[tuple[int, str]] = []
    mask_request_ids: list[str] = []
    masked_owners: list[tuple[int, str, SamplerRow]] = []
    decode_only, logprobs_k, any_penalty, any_ban, guided_in_flight = True, 0, False, False, False
    end = 0
    for b, s in enumerate(seqs):
        if s.new is not None:
            row = rows.admit(s.request_id, s.new, eos_for(s.request_id))
            decode_only = False
            if row.penalized:
                penalty_inits.append((row, s.new))
            if row.bias is not None:
                bias_inits.append((row, row.bias[0], row.bias[1]))
        else:
            row = rows.by_request[s.request_id]
        n, start, blocks = s.num_tokens, s.start_pos, s.block_ids
        if n == 1:
            if s.input_in_flight:
                input_ids.append(0)
                src_rows.append(row.index)
            else:
                input_ids.extend(s.token_ids)
                src_rows.append(-1)
            positions.append(start)
            slot_mapping.append(blocks[start // bs] * bs + start % bs)
        else:  # one-token decodes graph whether their input is known or input_in_flight
            decode_only = False
            input_ids.extend(s.token_ids)
            src_rows.extend([-1] * n)
            pos = np.arange(start, start + n, dtype=np.int32)
            positions.extend(pos.tolist())
            slot_mapping.extend((np.asarray(blocks, dtype=np.int32)[pos // bs] * bs + pos % bs).tolist())
        if len(blocks) != row.num_blocks:
            rows.update_blocks(row, blocks)
        end += n
        query_ends.append(end)
        seq_lens.append(start + n)
        row_index.append(row.index)
        offsets.append(s.output_index)
        if not s.sample:
            sample_rows.append(-1)
            continue
        p = row.params
        sample_rows.append(row.index)
        sampled.append((b, s.request_id))
        if p.logprobs is not None:
            logprobs_k = max(logprobs_k, p.logprobs, 1)
        any_penalty |= row.penalized
        if s.output_index < p.min_tokens and row.eos_ids:
            banned = row.eos_ids[:MAX_BANNED]
            ban_host[b, : len(banned)] = banned
            any_ban = True
        if row.bias is not None:
            biased += (b, row.index, len(row.bias[0]), int(row.bias[2]))
        if row.guided:
            mask_batch_rows.append(b)
            mask_request_ids.append(s.request_id)
            masked_owners.append((b, s.request_id, row))
            guided_in_flight |= s.input_in_flight
    return _BatchLists(input_ids, src_rows, positions, slot_mapping, query_ends, seq_lens, row_index,
                       offsets, sample_rows, biased, mask_batch_rows, penalty_inits, bias_inits, sampled,
                       mask_request_ids, masked_owners, decode_only, logprobs_k, any_penalty, any_ban,
                       guided_in_flight)


def _write_token_inputs(buf: SlotBuffers, lists: _BatchLists) -> int:
    """The forward's inputs into buf's host halves; returns the step's token count."""
    num_tokens, num_seqs = len(lists.input_ids), len(lists.query_ends)
    buf.input_ids[0][:num_tokens] = lists.input_ids
    buf.src_rows[0][:num_tokens] = lists.src_rows
    buf.positions[0][:num_tokens] = lists.positions
    buf.slot_mapping[0][:num_tokens] = lists.slot_mapping
    query_start_host = buf.query_start_loc[0]
    query_start_host[0] = 0
    query_start_host[1: num_seqs + 1] = lists.query_ends
    buf.seq_lens[0][:num_seqs] = lists.seq_lens
    last_index_host = buf.logits_indices[0]
    last_index_host[:num_seqs] = lists.query_ends
    last_index_host[:num_seqs] -= 1
    return num_tokens


def _write_sampler_rows(buf: SlotBuffers, lists: _BatchLists, deferred: bool) -> None:
    """The sampler's per-sequence rows into buf's host halves: which rows sample, which each pass
    records (a masked step's guided rows only in its second), biases and mask rows."""
    num_seqs = len(lists.sample_rows)
    buf.offsets[0][:num_seqs] = lists.offsets
    buf.sample_rows[0][:num_seqs] = lists.sample_rows
    record_host = buf.record_rows[0]
    record_host[:num_seqs] = lists.sample_rows
    masked = lists.mask_batch_rows
    if deferred:  # the guided rows are recorded by the second pass only
        masked_record_host = buf.masked_record_rows[0]
        masked_record_host[:num_seqs] = -1
        masked_record_host[masked] = record_host[masked]
        record_host[masked] = -1
    if lists.biased:
        buf.bias_sel[0][: len(lists.biased)] = lists.biased
    if masked:
        buf.mask_rows[0][: len(masked)] = masked


def upload_inputs(ops: Backend, buf: SlotBuffers, last_tokens: Any, num_tokens: int, num_seqs: int,
                  max_blocks: int, max_query_len: int, max_seq_len: int,
                  num_decodes: int = 0, cascade_blocks: int = 0) -> ForwardBatch:
    """Copy the staged step onto the device (on the current slot's stream) and fill the inputs
    that are the previous step's tokens from last_tokens; the forward's view of it."""
    def up(pair: HostDevice, n: int) -> Any:
        ops.copy_h2d(pair[1][:n], pair[0][:n])
        return pair[1][:n]

    ids = up(buf.input_ids, num_tokens)
    src = up(buf.src_rows, num_tokens)
    ops.fill_from_last(ids, src, last_tokens)
    for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "offsets", "presence",
                 "frequency", "repetition", "sample_rows", "record_rows"):
        up(getattr(buf, name), num_seqs)
    up(buf.ban, num_seqs * MAX_BANNED)
    return ForwardBatch(
        input_ids=ids,
        positions=up(buf.positions, num_tokens),
        slot_mapping=up(buf.slot_mapping, num_tokens),
        query_start_loc=up(buf.query_start_loc, num_seqs + 1),
        seq_lens=up(buf.seq_lens, num_seqs),
        block_tables=up(buf.block_tables, num_seqs * max_blocks).reshape(num_seqs, max_blocks),
        logits_indices=up(buf.logits_indices, num_seqs),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_decodes=num_decodes,
        cascade_blocks=cascade_blocks,
    )
