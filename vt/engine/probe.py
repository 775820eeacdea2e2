"""A probe step: one known-good request run alone, to tell a broken device from a bad batch.

When a step fails, its requests are failed. Whether the failure counts toward declaring the
engine dead depends on what caused it: a device that no longer runs anything, or something one
request brought. The probe answers that: a one-token greedy request with default parameters,
nothing else in the step. If it runs, the device is fine and the failure belonged to the failed
step's requests.
"""

from __future__ import annotations

from typing import Any

from vt.sampling_params import SamplingParams
from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq

PROBE_REQUEST_ID = "\x00vt-probe"  # no client can send this id: it is never a uuid
_PROBE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class ProbeUnavailable(RuntimeError):
    """No KV block was free to run the probe on: the failure stays unexplained."""


async def run_probe(runner: Any, pool: Any) -> BaseException | None:
    """Run the probe step on `runner` with one block borrowed from `pool`; None if it ran, else
    what it raised (ProbeUnavailable if no block was free). No other step may be in flight."""
    blocks = pool.allocate(1)
    if blocks is None:
        return ProbeUnavailable("no free KV block to run a probe step on")
    seq = ScheduledSeq(request_id=PROBE_REQUEST_ID, start_pos=0, num_tokens=1, token_ids=(0,),
                       input_in_flight=False, block_ids=tuple(blocks), sample=True, output_index=0,
                       new=NewRequestData(prompt_token_ids=(0,), output_token_ids=(), params=_PROBE_PARAMS))
    try:
        handle = runner.execute(ScheduledBatch(seqs=(seq,), released=(), num_tokens=1), lambda _: ())
        await handle.wait()
    except Exception as exc:
        return exc
    finally:
        runner.release(PROBE_REQUEST_ID)
        pool.free(blocks)
    return None
