"""A mixed step split in two (VT_SPLIT_DECODE_SMS, an experiment): its decodes run as one step and
its prompt rows as another beside it on the device, each with its GEMMs held to a share of the
SMs. The step beside runs after what the step before it runs after, not after that step; the
next step runs after both; the tokens are those of the one mixed step."""

from __future__ import annotations

import numpy as np
import pytest

from vt.config import EngineConfig, ModelConfig
from vt.kernels.numpy_ops import NumpyBackend
from vt.llm import LLM
from vt.model.make_model import make_model
from vt.runner.runner import ModelRunner
from vt.sampling_params import SamplingParams
from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return make_model(tmp_path_factory.mktemp("split"), preset="tiny")


class RecordingOps(NumpyBackend):
    """The numpy backend, noting each stream wait (i after j) and GEMM SM limit it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def after(self, i: int, j: int) -> None:
        super().after(i, j)
        self.log.append(("after", i, j))

    def limit_gemm_sms(self, i: int, sms: int) -> None:
        super().limit_gemm_sms(i, sms)
        self.log.append(("sms", i, sms))


def _prompt(rid: str, blocks: tuple[int, ...]) -> ScheduledSeq:
    ids = (5, 6, 7)
    return ScheduledSeq(rid, 0, 3, ids, False, blocks, True, 0,
                        NewRequestData(ids, (), SamplingParams(max_tokens=8, temperature=0.0)))


def test_a_step_beside_the_previous_waits_for_what_that_one_waits_for(model) -> None:
    ops = RecordingOps()
    cfg = EngineConfig(model=str(model), device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    runner = ModelRunner(ModelConfig.from_dir(model), cfg, ops, 256)
    try:
        eos = lambda _r: ()  # noqa: E731
        first = runner.execute(ScheduledBatch((_prompt("a", (0,)),), (), 3), eos)
        first.result()
        ops.log.clear()
        d = runner.execute(ScheduledBatch((_prompt("b", (1,)),), (), 3), eos, gemm_sms=16)
        p = runner.execute(ScheduledBatch((_prompt("c", (2,)),), (), 3), eos, parallel_to_previous=True,
                           gemm_sms=100)
        nxt = runner.execute(ScheduledBatch((_prompt("e", (3,)),), (), 3), lambda _r: ())
        for h in (d, p, nxt):
            h.result()
        s0, sd, sp, sn = first.slot, d.slot, p.slot, nxt.slot
        assert len({sd, sp}) == 2
        # d runs after the step before it; p beside d: after what d runs after, not after d
        assert ("after", sd, s0) in ops.log and ("after", sp, sd) not in ops.log
        assert ("after", sp, s0) in ops.log or sp == s0
        # the next step runs after both
        assert {("after", sn, sd), ("after", sn, sp)} - {("after", sn, sn)} <= set(ops.log)
        assert [e for e in ops.log if e[0] == "sms"] == [("sms", sd, 16), ("sms", sp, 100), ("sms", sn, 0)]
    finally:
        runner.shutdown()


@pytest.mark.parametrize("engine", [dict(), dict(async_scheduling=False),
                                    dict(num_gpu_blocks=200, block_size=16)])  # the last preempts
def test_split_steps_give_the_mixed_steps_tokens(model, engine) -> None:
    rng = np.random.default_rng(1)
    # enough requests that SPLIT_MIN_DECODES decode beside later prompts
    prompts = [rng.integers(3, 200, size=n).tolist() for n in rng.integers(5, 90, size=48)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = {}
    for k in (0, 16):
        with LLM(str(model), device="cpu", max_num_seqs=64, max_num_batched_tokens=96,
                 split_decode_sms=k, **engine) as llm:
            got[k] = [o.token_ids for o in llm.generate(prompts, params)]
            assert (llm.engine.split_steps > 0) == bool(k)
            if "num_gpu_blocks" in engine:
                assert llm.engine.stats().num_preemptions_total > 0
            llm.engine.scheduler.check_invariants()
            assert llm.engine.scheduler.kv_usage == 0.0
    assert got[16] == got[0]


def test_split_setting_is_checked(model, monkeypatch) -> None:
    monkeypatch.setenv("VT_SPLIT_DECODE_SMS", "lots")
    with pytest.raises(ValueError, match="VT_SPLIT_DECODE_SMS"):
        LLM(str(model), device="cpu")
