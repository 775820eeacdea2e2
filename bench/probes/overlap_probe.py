"""Can a step's prompt rows and its decode rows run side by side, on two streams, in less time
than the one mixed step that carries both?

    python3 -m bench.probes.overlap_probe --preset 8b --decodes 227 --context 1088 --prompt 1820 \\
        --sms 0,16,32,48

The mixed steps of the 8B 1024/128 row are GEMMs at the matrix rate (compute) plus the decodes'
attention at copy bandwidth (memory), one after the other. If the decodes ran as a step of their
own on one stream while the prompt rows ran as another on a second stream, each with cuBLAS held
to part of the SMs (`cublasSetSmCountTarget`: the prompt step's GEMMs to all but k SMs, the
decode step's to k), the memory-bound work could hide under the compute-bound work. This times,
on random weights (bench/step/decode_step.py's runner with its graphs, as `vt serve` runs; a step
whose GEMMs are held to part of the SMs runs eager, so that every GEMM is held):

- mixed: one step with the decodes and the prompt chunk (how vt runs them today);
- prompt alone, decodes alone (each with the whole device);
- side by side at each k of --sms (0: no SM target): the decode step launched, then the prompt
  step beside it (`ModelRunner.execute(..., parallel_to_previous=True)`: the two touch different
  sequences and KV blocks), and the time until both are done: what `VT_SPLIT_DECODE_SMS=k`
  makes `vt serve` do with every mixed step.

Wall times per step from the host (launch of the first to completion of the last), median of
--reps. The decodes read their tokens from the host (no dependence on the step before), so the
pair is independent by construction; the tokens themselves are not checked.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.step.decode_step import STEPS_MAX, blocks_per_seq, build_runner


def batches(decodes: int, context: int, prompt: int):
    """(admit, step(i, with_decodes, with_prompt)): the first admits every decode row; step i
    decodes at context + i and/or prefills prompt p{i} (releasing p{i - 1})."""
    from vt.sampling_params import SamplingParams
    from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq

    nb = blocks_per_seq(context)
    params = SamplingParams(max_tokens=10_000, temperature=0.0)
    tables = [tuple(range(b * nb, (b + 1) * nb)) for b in range(decodes)]
    admit = ScheduledBatch(tuple(
        ScheduledSeq(f"r{b}", context - 1, 1, (5,), False, tables[b], True, 0,
                     NewRequestData((5,) * 4, (), params)) for b in range(decodes)), (), decodes)
    spare = tuple(range(decodes * nb, decodes * nb + -(-prompt // 16)))
    ids = tuple(range(7, 7 + prompt))

    live: list[str] = []  # the prompt admitted last, released by the next step that admits one

    def step(i: int, with_decodes: bool, with_prompt: bool) -> ScheduledBatch:
        seqs: tuple = ()
        if with_decodes:
            seqs += tuple(ScheduledSeq(f"r{b}", context + i, 1, (5,), False, tables[b], True, i + 1, None)
                          for b in range(decodes))
        released: tuple[str, ...] = ()
        if with_prompt:
            new = NewRequestData(ids, (), params)
            seqs += (ScheduledSeq(f"p{i}", 0, prompt, ids, False, spare, True, 0, new),)
            released, live[:] = tuple(live), [f"p{i}"]
        return ScheduledBatch(seqs, released, len(seqs) - with_prompt + prompt * with_prompt)

    return admit, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--decodes", type=int, default=227)
    ap.add_argument("--context", type=int, default=1088)
    ap.add_argument("--prompt", type=int, default=1820)
    ap.add_argument("--sms", default="0,16,24,32,48", help="SMs the decode step's GEMMs get (0: no target)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same steps on the numpy backend (checks the script, times nothing real)")
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()

    runner, _ = build_runner(args.preset, args.decodes, args.context, enforce_eager=False,
                             prefill=args.prompt, device=args.device, quantization=args.quantization,
                             kv_cache_dtype=args.kv_cache_dtype)
    nsm = runner.ops.num_sms() or 132  # numpy: any number, nothing is held
    sync = lambda: None  # noqa: E731
    if args.device == "cuda":
        import cupy

        sync = cupy.cuda.Device().synchronize
    eos = lambda _rid: ()  # noqa: E731
    admit, step = batches(args.decodes, args.context, args.prompt)
    runner.execute(admit, eos).result()
    # every timed call decodes one position further: the decode rows' blocks hold STEPS_MAX of them
    counter = iter(range(1, STEPS_MAX - 2))

    def timed(launches: list[tuple[bool, bool, bool, int]]) -> float:
        """Wall seconds of the steps launched back to back, each (decodes, prompt, beside the
        one before, GEMM SMs), until all are done."""
        i = next(counter)
        sync()
        t0 = time.perf_counter()
        handles = [runner.execute(step(i, d, p), eos, parallel_to_previous=beside, gemm_sms=sms)
                   for d, p, beside, sms in launches]
        for h in handles:
            h.result()
        return time.perf_counter() - t0

    def median_ms(*launches: tuple[bool, bool, bool, int]) -> float:
        timed(list(launches))  # warm-up
        return 1e3 * statistics.median(timed(list(launches)) for _ in range(args.reps))

    print(f"{args.preset}: {args.decodes} decodes at {args.context} keys, a {args.prompt}-token prompt; "
          f"{nsm} SMs; ms a step, median of {args.reps}")
    mixed = median_ms((True, True, False, 0))
    print(f"| mixed step | {mixed:.2f} |")
    print(f"| prompt alone | {median_ms((False, True, False, 0)):.2f} |")
    print(f"| decodes alone | {median_ms((True, False, False, 0)):.2f} |")
    serial = median_ms((True, False, False, 0), (False, True, False, 0))
    print(f"| decodes then prompt, serial | {serial:.2f} |")
    for k in (int(x) for x in args.sms.split(",")):
        rest = nsm - k if k else 0
        if k:
            print(f"| decodes alone, GEMMs on {k} SMs | {median_ms((True, False, False, k)):.2f} |")
            print(f"| prompt alone, GEMMs on {rest} SMs | {median_ms((False, True, False, rest)):.2f} |")
        both = median_ms((True, False, False, k), (False, True, True, rest))
        print(f"| side by side, decode GEMMs on {k or 'any'} SMs | {both:.2f} | {mixed / both:.3f}x mixed |")

if __name__ == "__main__":
    main()
