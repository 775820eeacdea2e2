"""`vt` with the device step replaced by a timed stand-in: the host's share of serving, measured
against a device of a given speed, on a machine without that device.

    python3 -m bench.serving.emulated_device --step-ms 3.4 --token-us 2 serve --model DIR --device cpu ...
    python3 -m bench.serving.emulated_device --cost-model serve --model DIR --device cpu ...

Everything after the emulation's own flags is `vt`'s command line. The server is the CPU build
of vt (numpy backend, one step worker) in which a step's device part does no arithmetic: it
takes `--step-ms` plus `--token-us` per token of the step on a clock of its own (sleeping,
which leaves the host's cores free, as a GPU does), then writes token ids. A guided row's token
is one its staged bitmask allows, so structured outputs run their real grammar work: the masks
are filled, and a step's guided rows are sampled by its second sampler pass once they are
(`ModelRunner.sample_deferred`), exactly as on CUDA. What remains to measure
is the event loop's and the grammar threads' work against a device that never waits for the
host, which is what decides whether guided rows cost the free rows of their batch anything.

Free rows get arbitrary valid ids; nothing about the text is meaningful. The emulated step has
one speed for every batch size, so pick `--step-ms` from a measured step of the shape served
(RESULTS.md: a 0.6B decode step at batch 128 is about 3.4 ms on the H200).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import sys
import time
from typing import Any

import numpy as np

FREE_IDS = 900  # free rows sample ids 5..904: below any vocabulary vt builds, above the specials


def allowed_token(words: np.ndarray, start: int) -> int:
    """A token a packed bitmask row allows (bit t of word t // 32), the first at or after the
    word `start` (wrapping); -1 if none is allowed."""
    n = len(words)
    start %= n
    hits = np.flatnonzero(words[start:])
    if len(hits):
        w = start + int(hits[0])
    else:
        hits = np.flatnonzero(words[:start])
        if not len(hits):
            return -1
        w = int(hits[0])
    bits = int(words[w]) & 0xFFFFFFFF
    return w * 32 + ((bits & -bits).bit_length() - 1)


class DeviceClock:
    """When the emulated device would finish each job, as a GPU stream would run them: a job
    starts once it is launched and the one before it has ended. The step worker runs the jobs
    and sleeps until that time, so a late wake of the worker thread (it needs the GIL, which
    the event loop may hold for milliseconds) does not push every later job back, as the
    device, which needs no GIL, would not be."""

    def __init__(self) -> None:
        self.end = 0.0
        self.launched = 0.0  # when the job now running was handed to the worker

    def run(self, seconds: float) -> None:
        self.end = max(self.end, self.launched) + seconds
        delay = self.end - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class LaunchingExecutor:
    """The step worker, noting when each job was launched for the clock. A deferred step's
    second sampler pass runs on a stream of its own, as on CUDA (its slot's stream, while the
    next step runs on the other): it waits for its step's first pass, not for the steps
    launched after that one, and a step launched after it runs after it."""

    def __init__(self, inner: Any, clock: DeviceClock, second_pass: Any) -> None:
        self.inner, self.clock, self.second_pass = inner, clock, second_pass
        self.side = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="emulated-second-pass")
        self.last_second_pass: concurrent.futures.Future | None = None

    def _run(self, launched: float, after: concurrent.futures.Future | None, fn: Any, args: tuple) -> Any:
        if after is not None:
            concurrent.futures.wait([after])
        self.clock.launched = launched
        return fn(*args)

    def submit(self, fn: Any, *args: Any) -> Any:
        if args and getattr(args[0], "__func__", None) is self.second_pass:
            self.last_second_pass = self.side.submit(fn, *args)
            return self.last_second_pass
        return self.inner.submit(self._run, time.monotonic(), self.last_second_pass, fn, args)

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait=wait)
        self.side.shutdown(wait=wait)


def install(step_ms: float, token_us: float, cost_model: bool = False) -> None:
    """Replace ModelRunner's device part with the timed stand-in (for this process). With
    cost_model, a step takes what bench/serving/schedule_sim.py's StepCost prices its batch at (the
    8B steps of an H100, padded to the layer graph sizes as CUDA graphs pad them) instead."""
    from vt.runner import runner

    init = runner.ModelRunner.__init__
    execute = runner.ModelRunner.execute
    cost = None
    if cost_model:
        from bench.serving.schedule_sim import StepCost

        cost = StepCost()

    def with_clock(self: runner.ModelRunner, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        self.emulated_clock = DeviceClock()
        self.emulated_costs = collections.deque()  # each executed step's seconds, in launch order
        self.worker = LaunchingExecutor(self.worker, self.emulated_clock, resume_sample)

    def priced(self: runner.ModelRunner, batch: Any, *a: Any, **k: Any) -> Any:
        self.emulated_costs.append(cost.seconds(batch) if cost is not None else None)
        return execute(self, batch, *a, **k)

    def sample(rn: runner.ModelRunner, st: Any, out: np.ndarray, masked: bool) -> None:
        buf = rn.slots[st.slot]
        nseq = st.nseq
        out[:nseq] = (np.arange(nseq) * 7 + rn.step_id * 13) % FREE_IDS + 5
        if masked and st.num_masks:
            masks = buf.bitmask[0][: st.num_masks * rn.mask_words].reshape(st.num_masks, rn.mask_words)
            for i, b in enumerate(buf.mask_rows[0][: st.num_masks]):
                tok = allowed_token(masks[i], rn.step_id * 31 + int(b) * 17)
                if tok >= 0:
                    out[b] = tok

    def device_step(self: runner.ModelRunner, st: Any) -> None:
        seconds = self.emulated_costs.popleft() if self.emulated_costs else None
        if seconds is None:
            seconds = (step_ms * 1e3 + token_us * st.ntok) / 1e6
        self.emulated_clock.run(seconds)
        # a deferred step's first pass: its guided rows come from the second (sample_deferred)
        sample(self, st, self.slots[st.slot].out.ids, not st.deferred)

    def resume_sample(self: runner.ModelRunner, job: tuple[Any, Any]) -> None:
        st, forward = job
        if forward is not None:
            forward.result()  # the step's first pass; the sampler's own time is in the step's
        sample(self, st, self.slots[st.slot].masked_out.ids, True)

    runner.ModelRunner.__init__ = with_clock
    runner.ModelRunner.execute = priced
    if cost is not None:  # the model pads steps as CUDA's layer graphs do: say so to the scheduler
        runner.ModelRunner.padded_step_sizes = property(lambda rn: rn.layer_graph_sizes)
    runner.ModelRunner._device_step = device_step
    runner.ModelRunner._resume_sample = resume_sample


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", type=float, default=None, help="device time of every step")
    ap.add_argument("--token-us", type=float, default=0.0, help="device time added per token of a step")
    ap.add_argument("--cost-model", action="store_true",
                    help="price each step by bench/serving/schedule_sim.py's StepCost (8B on an H100) "
                         "instead")
    args, rest = ap.parse_known_args(argv)
    if (args.step_ms is None) == (not args.cost_model):
        ap.error("give either --step-ms or --cost-model")
    if not rest or rest[0] != "serve":
        ap.error("give vt's command after the emulation's flags: ... serve --model DIR --device cpu")
    if "cpu" not in rest and "numpy" not in rest:
        ap.error("the emulation replaces the CPU backend's step: pass --device cpu")
    install(args.step_ms or 0.0, args.token_us, args.cost_model)
    from vt.launch import cli

    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
