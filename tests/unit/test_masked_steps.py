"""A step whose guided rows wait for their masks keeps its slot, and only its slot.

At depth 2 a step with guided rows samples them in a second pass once their masks are filled.
Its free rows are collected first; while the masks fill, later steps launch on the other
slots (the runner has three), and the masked step's staged inputs, parked logits and outputs stay
untouched until its second pass is collected.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from vt.config import EngineConfig, ModelConfig
from vt.kernels.numpy_ops import NumpyBackend
from vt.model.make_model import make_model
from vt.runner.runner import ModelRunner
from vt.sampling_params import SamplingParams
from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq
from vt.structured.spec import GrammarSpec, StructuredOutput

BLOCKS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = make_model(tmp_path_factory.mktemp("masked"), preset="tiny")
    cfg = EngineConfig(model=str(path), device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    r = ModelRunner(ModelConfig.from_dir(path), cfg, NumpyBackend(), 256)
    yield r
    r.shutdown()


def _seq(rid: str, params: SamplingParams, prompt: tuple[int, ...] = (5, 6, 7)) -> ScheduledSeq:
    return ScheduledSeq(rid, 0, len(prompt), prompt, False, BLOCKS, True, 0,
                        NewRequestData(prompt, (), params))


def _allow(token: int):
    def fill(_rids, out: np.ndarray) -> None:
        out.fill(0)
        out[:, token // 32] = 1 << (token % 32)
    return fill


def test_a_masked_step_keeps_its_slot_while_later_steps_run(runner: ModelRunner) -> None:
    regex = StructuredOutput(GrammarSpec("regex", "a"))
    guided = SamplingParams(max_tokens=4, temperature=0.0, structured=regex)
    free = SamplingParams(max_tokens=4, temperature=0.0)
    masked = runner.execute(ScheduledBatch((_seq("g", guided), _seq("f", free)), (), 6), lambda _r: (),
                            _allow(77), defer_masks=True)
    assert masked.awaiting_masks and masked.has_free_rows
    first = asyncio.run(masked.wait_first())
    assert [t.request_id for t in first.sampled] == ["f"]
    # Two more steps launch while its masks are still to come, each on a slot of its own.
    later = [runner.execute(ScheduledBatch((_seq(f"x{i}", free),), ("f",), 3), lambda _r: ())
             for i in range(2)]
    assert len({masked.slot, *(h.slot for h in later)}) == 3
    assert not runner.has_free_slot
    with pytest.raises(RuntimeError, match="every slot"):
        runner.execute(ScheduledBatch((_seq("y", free),), (), 3), lambda _r: ())
    # A finished step frees its slot; the next step takes that one, never the masked step's.
    later[0].result()
    assert runner.has_free_slot
    again = runner.execute(ScheduledBatch((_seq("z", free),), (), 3), lambda _r: ())
    assert again.slot == later[0].slot
    # The second pass samples the guided row with the masks it gets now (only token 77 allowed).
    runner.sample_deferred(masked, _allow(77))
    out = masked.result()
    assert [(t.request_id, t.token_id) for t in out.sampled] == [("g", 77)]
    for h in (later[1], again):
        h.result()
    assert None in runner._owner and runner.has_free_slot
