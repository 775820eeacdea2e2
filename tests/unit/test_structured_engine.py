"""Structured outputs in the engine: every guided output follows its grammar, and depth 2 samples
exactly the tokens of depth 1 in batches that mix guided and free requests, with preemption.

At depth 2 a guided request's step N+1 is launched before step N's token is known; its sampler
waits for the mask, which the engine computes once N is processed (runner.deferred_samples
counts those steps). The reference is the same workload at depth 1, where every mask is known
at launch.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.kernels import numpy_sampling
from vt.model.make_model import make_model, training_corpus
from vt.sampling_params import SamplingParams
from vt.structured.compiler import MASK_THREADS, GrammarCompiler, GrammarError
from vt.structured.spec import GrammarSpec, StructuredOutput
from vt.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMARS = {
    "json": GrammarSpec("json", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", REGEX),
    "choice": GrammarSpec("choice", json.dumps(CHOICES)),
}


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("guided") / "m", preset="tiny")


def _prompt(rng: np.random.Generator, tokenizer: Tokenizer) -> list[int]:
    """Text prompts: random ids may end inside a UTF-8 sequence, whose bytes the detokenizer
    would then show in front of the output."""
    words = training_corpus(40)
    picks = rng.integers(0, len(words), size=int(rng.integers(1, 5)))
    return tokenizer.encode(" ".join(words[int(i)] for i in picks))


def _workload(tokenizer: Tokenizer, n: int = 24) -> list[tuple[list[int], SamplingParams, str | None]]:
    """Mixed: a third free, the rest guided by a JSON schema, a regex or a choice; seeded at
    temperature 1, some with top_p / top_k and penalties, one greedy of each kind."""
    rng = np.random.default_rng(11)
    kinds = [None, "json", "regex", "choice"]
    out = []
    for i in range(n):
        kind = kinds[i % 4] if i % 3 else kinds[i % 4 and 1]
        structured = StructuredOutput(GRAMMARS[kind]) if kind else None
        extra = {"top_p": 0.9, "top_k": 50} if i % 5 == 1 else {}
        if i % 7 == 3:
            extra["presence_penalty"] = 0.5
        temperature = 0.0 if i in (1, 2, 3) else 1.0
        params = SamplingParams(max_tokens=400 if kind else 30, temperature=temperature, seed=100 + i,
                                structured=structured, **extra)
        out.append((_prompt(rng, tokenizer), params, kind))
    return out


async def _tokens(stream) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


async def _run(model_dir: Path, graphs: bool = False,
               **engine_args: object) -> tuple[list[tuple[list[int], str, str]], AsyncEngine]:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=16, **engine_args))
    await engine.start()
    if graphs:
        engine.runner.capture_graphs()  # as on CUDA: decode steps replay the captured decode graph
    try:
        work = _workload(engine.tokenizer)
        for spec in GRAMMARS.values():
            await engine.compile_grammar(spec)
        streams = [engine.add_request(f"r{i}", p, params) for i, (p, params, _) in enumerate(work)]

        async def drain(stream) -> tuple[list[int], str, str]:
            toks, text = [], []
            async for out in stream:
                toks.extend(out.token_ids)
                text.append(out.text)
                last = out
            assert last.error is None, last.error
            return toks, "".join(text), last.finish_reason

        results = await asyncio.gather(*(drain(s) for s in streams))
    finally:
        await engine.stop()
    return list(results), engine


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> dict[str, tuple[list, AsyncEngine]]:
    # 40 blocks of 16 tokens for 16 running sequences: the pool runs short and preempts
    small = {"num_gpu_blocks": 40, "block_size": 16}
    return {name: asyncio.run(_run(model_dir, **args)) for name, args in (
        ("depth2", {"async_scheduling": True, **small}),
        ("depth1", {"async_scheduling": False, **small}),
        ("depth2-graphs", {"async_scheduling": True, "graphs": True, **small}),
    )}


def test_guided_outputs_follow_their_grammar(runs) -> None:
    results, engine = runs["depth2"]
    for (_, _, kind), (_, text, reason) in zip(_workload(engine.tokenizer), results):
        if kind is not None:
            assert reason == "stop", (kind, text)
            assert follows(kind, text), (kind, text)


def test_depth_two_samples_the_tokens_of_depth_one(runs) -> None:
    two, engine2 = runs["depth2"]
    one, engine1 = runs["depth1"]
    assert [t for t, _, _ in two] == [t for t, _, _ in one]
    # the exactness was exercised: depth 2 deferred guided samplers and preempted, depth 1 never deferred
    assert engine2.runner.deferred_samples > 20
    assert engine1.runner.deferred_samples == 0
    assert engine2.scheduler.num_preemptions_total > 0


def test_deferred_masks_fill_off_the_event_loop(model_dir: Path, runs, monkeypatch) -> None:
    """At depth 2 the masks of a step waiting for them are filled on the mask thread while the
    loop processes the step before; the tokens stay depth 1's."""
    threads: list[str] = []
    fill = GrammarCompiler.fill_masks

    def recording(self, guides, out) -> None:
        threads.append(threading.current_thread().name)
        fill(self, guides, out)

    monkeypatch.setattr(GrammarCompiler, "fill_masks", recording)
    results, engine = asyncio.run(_run(model_dir, async_scheduling=True, num_gpu_blocks=40, block_size=16))
    assert [t for t, _, _ in results] == [t for t, _, _ in runs["depth1"][0]]
    off_loop = sum(name.startswith("vt-masks") for name in threads)
    assert off_loop == len(threads), threads
    # the last step (the extra one after every request finished) may have its masks filled when
    # the engine stops, and never sample
    assert engine.runner.deferred_samples <= off_loop <= engine.runner.deferred_samples + 1, off_loop
    assert engine.runner.deferred_samples > 20


def test_slow_masks_sit_out_only_their_own_requests(model_dir: Path, runs, monkeypatch) -> None:
    """Masks slower than a step: the guided requests sit steps out while the next steps launch
    without waiting for them (the free rows sample in the first pass), a step waited for before
    its masks are filled has its free rows processed first and, with a slot to spare, is kept
    masked while the next step launches, and every token is still depth 1's."""
    fill = GrammarCompiler.fill_masks

    def slow(self, guides, out) -> None:
        time.sleep(0.02)
        fill(self, guides, out)

    monkeypatch.setattr(GrammarCompiler, "fill_masks", slow)
    results, engine = asyncio.run(_run(model_dir, async_scheduling=True, num_gpu_blocks=40, block_size=16))
    assert [t for t, _, _ in results] == [t for t, _, _ in runs["depth1"][0]]
    assert engine.guided_steps.sat_out_total > 20
    assert runs["depth2"][1].guided_steps.sat_out_total < engine.guided_steps.sat_out_total
    assert engine.guided_steps.early_first_passes > 5
    # steps launched while an earlier one's masks still filled
    assert engine.guided_steps.masked_steps_total > 0


def test_a_masked_steps_failed_masks_fail_only_its_guided_requests(model_dir: Path, runs,
                                                                   monkeypatch) -> None:
    """Slow masks leave steps masked; one fill fails: the guided requests of that step end with an
    error, every other request gets depth 1's tokens, and the engine goes on serving with every
    slot free at the end."""
    fill = GrammarCompiler.fill_masks
    calls = []

    def flaky(self, guides, out) -> None:
        calls.append(len(guides))
        time.sleep(0.02)
        if len(calls) == 8:
            raise RuntimeError("mask fill failed")
        fill(self, guides, out)

    monkeypatch.setattr(GrammarCompiler, "fill_masks", flaky)

    async def run() -> tuple[list[tuple[list[int], str | None]], AsyncEngine]:
        engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=16,
                                          num_gpu_blocks=40, block_size=16))
        await engine.start()
        try:
            for spec in GRAMMARS.values():
                await engine.compile_grammar(spec)
            streams = [engine.add_request(f"r{i}", p, params)
                       for i, (p, params, _) in enumerate(_workload(engine.tokenizer))]

            async def drain(stream) -> tuple[list[int], str | None]:
                toks = []
                async for out in stream:
                    toks.extend(out.token_ids)
                    last = out
                return toks, last.error

            results = await asyncio.gather(*(drain(st) for st in streams))
            after = await _tokens(engine.add_request("after", [5, 6, 7], SamplingParams(max_tokens=4)))
        finally:
            slots_free = engine.runner.has_free_slot and None in engine.runner._owner
            await engine.stop()
        assert len(after) == 4 and slots_free and engine.guided_steps.masked_steps_total > 0
        return list(results), engine

    results, _ = asyncio.run(run())
    failed = [i for i, (_, err) in enumerate(results) if err is not None]
    assert failed and all("mask fill failed" in results[i][1] for i in failed)
    kinds = [kind for _, _, kind in _workload(runs["depth1"][1].tokenizer)]
    assert all(kinds[i] is not None for i in failed)  # only guided requests fail
    for i, ((toks, err), (want, _, _)) in enumerate(zip(results, runs["depth1"][0], strict=True)):
        if err is None:
            assert toks == want, i


def test_guided_rows_keep_the_decode_graph(runs) -> None:
    """With graphs, decode steps with guided rows replay the decode graph's two parts, the masks
    applied between them (after the previous step's tokens, at depth 2), and sample depth 1's
    tokens."""
    graphs, engine = runs["depth2-graphs"]
    assert [t for t, _, _ in graphs] == [t for t, _, _ in runs["depth1"][0]]
    assert engine.runner.guided_routes["graph"] > 20, engine.runner.guided_routes
    assert engine.runner.deferred_samples > 20


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_guided_tokens_are_the_same_on_two_ranks(model_dir: Path, runs, graphs: bool) -> None:
    """Tensor parallelism keeps structured outputs exact: masks apply on every rank's gathered
    logits, so two ranks sample one rank's tokens (depth 2, with preemption)."""
    two_ranks, _ = asyncio.run(_run(model_dir, graphs, async_scheduling=True, num_gpu_blocks=40,
                                    block_size=16, tensor_parallel_size=2))
    assert [t for t, _, _ in two_ranks] == [t for t, _, _ in runs["depth2"][0]]


def test_free_requests_sample_as_if_alone(model_dir: Path, runs) -> None:
    """A guided request in the batch changes nothing for the others: the free requests of the
    mixed run equal a run of the free requests alone."""
    two, engine = runs["depth2"]
    work = _workload(engine.tokenizer)
    free = [i for i, (_, _, kind) in enumerate(work) if kind is None]

    async def alone() -> list[list[int]]:
        engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=16))
        await engine.start()
        try:
            streams = [engine.add_request(f"f{i}", work[i][0], work[i][1]) for i in free]
            return list(await asyncio.gather(*map(_tokens, streams)))
        finally:
            await engine.stop()

    assert asyncio.run(alone()) == [two[i][0] for i in free]


def test_bitmask_op_masks_exactly_the_cleared_bits() -> None:
    rng = np.random.default_rng(5)
    b, v = 6, 1000  # 32 words, the last one partly past the vocabulary
    logits = rng.standard_normal((b, v)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(4, -(-v // 32)), dtype=np.int64).astype(np.int32)
    rows = np.array([4, -1, 0, 2], np.int32)
    out = logits.copy()
    numpy_sampling.apply_token_bitmask(out, bitmask, rows)
    expect = logits.copy()
    for m, row in enumerate(rows):
        if row < 0:
            continue
        for t in range(v):
            if not (int(bitmask[m, t // 32]) >> (t % 32)) & 1:
                expect[row, t] = -np.inf
    np.testing.assert_array_equal(out, expect)
    short = logits.copy()  # fewer words than the vocabulary needs: the rest is cleared
    numpy_sampling.apply_token_bitmask(short, np.full((1, 2), -1, np.int32), np.array([3], np.int32))
    assert np.isneginf(short[3, 64:]).all() and (short[3, :64] == logits[3, :64]).all()


def test_invalid_grammars_fail_to_compile_with_the_reason(model_dir: Path) -> None:
    async def go() -> list[str]:
        engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu"))
        errors = []
        try:
            for spec in (GrammarSpec("json", '{"type": "nope"}'), GrammarSpec("regex", "a(b"),
                         GrammarSpec("grammar", "start: undefined_rule"), GrammarSpec("json", "[1"),
                         GrammarSpec("regex", r"[^\s\S]")):
                with pytest.raises(GrammarError) as e:
                    await engine.compile_grammar(spec)
                errors.append(str(e.value))
            good = GrammarSpec("regex", "[0-9]+")
            assert await engine.compile_grammar(good) is await engine.compile_grammar(good)  # cached
        finally:
            await engine.stop()
        return errors

    errors = asyncio.run(go())
    assert "nope" in errors[0] and "unclosed group" in errors[1] and "undefined_rule" in errors[2]
    assert "not valid JSON" in errors[3] and "admits no output" in errors[4]


def test_the_grammar_applies_from_the_gate_token_on(model_dir: Path) -> None:
    """start_after: the output is the free output up to and including the gate token, and
    follows the grammar from the next token on. The gate is the token the free outputs hold most
    often, so most requests reach it."""

    async def run(spec: StructuredOutput | None) -> list[list[int]]:
        engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=32))
        await engine.start()
        try:
            streams = [engine.add_request(f"g{i}", [7, 8, 9 + i], SamplingParams(
                max_tokens=200, temperature=1.0, seed=i, ignore_eos=True, structured=spec))
                for i in range(32)]
            return list(await asyncio.gather(*map(_tokens, streams)))
        finally:
            await engine.stop()

    free = asyncio.run(run(None))
    counts = np.bincount([t for toks in free for t in set(toks[1:])])
    gate = int(np.argmax(counts))
    gated = asyncio.run(run(StructuredOutput(GrammarSpec("regex", REGEX), start_after=gate)))
    tokenizer = Tokenizer.from_dir(model_dir)
    reached = 0
    for before, toks in zip(free, gated):
        if gate not in before:
            assert toks == before  # never gated: the free output
            continue
        reached += 1
        cut = before.index(gate) + 1
        assert toks[:cut] == before[:cut]
        assert re.fullmatch(REGEX, tokenizer.decode(toks[cut:])), tokenizer.decode(toks[cut:])
    assert reached >= 16


def test_mask_rows_follow_their_guides_across_template_shards(model_dir: Path) -> None:
    """Requests are dealt in turn to the compiled grammar's independent templates (one per mask
    thread), and a step's masks, filled grouped by template, land in their own rows: each row
    equals the mask of its guide filled alone, whatever its template and state."""
    text = (model_dir / "tokenizer.json").read_text()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(lambda: text, vocab, ())
    structured = StructuredOutput(GRAMMARS["json"])
    guides = [compiler.guide(structured) for _ in range(3 * MASK_THREADS)]
    assert [g.shard for g in guides] == [i % MASK_THREADS for i in range(len(guides))]
    masks = np.zeros((len(guides), compiler.mask_words), np.int32)
    alone = np.zeros((1, compiler.mask_words), np.int32)
    rng = np.random.default_rng(3)
    try:
        for step in range(10):
            compiler.fill_masks(guides, masks)
            for i, g in enumerate(guides):
                compiler.fill_masks([g], alone)
                np.testing.assert_array_equal(masks[i], alone[0])
            for i, g in enumerate(guides):  # rows drift apart: every third one waits a step
                if (i + step) % 3:
                    bits = np.unpackbits(masks[i].view(np.uint8), bitorder="little")[:vocab]
                    assert g.advance(int(rng.choice(np.flatnonzero(bits)))) is None
        assert len({m.tobytes() for m in masks}) > 1  # the rows' states differ
    finally:
        compiler.shutdown()
