"""Can a step's prompt rows and its decode rows run side by side, on two streams, in less time
than the one mixed step that carries both?

    python3 bench/overlap_probe.py --preset 8b --decodes 227 --context 1088 --prompt 1820 --sms 0,16,32,48

The mixed steps of the 8B 1024/128 row are GEMMs at the matrix rate (compute) plus the decodes'
attention at copy bandwidth (memory), one after the other. If the decodes ran as a step of their
own on one stream while the prompt rows ran as another on a second stream, each with cuBLAS held
to part of the SMs (`cublasSetSmCountTarget`: the prompt step's GEMMs to all but k SMs, the
decode step's to k), the memory-bound work could hide under the compute-bound work. This times,
on random weights (bench/decode_step.py's runner, eager so the SM targets reach every GEMM):

- mixed: one step with the decodes and the prompt chunk (how vt runs them today);
- prompt alone, decodes alone (each with the whole device);
- side by side at each k of --sms (0: no SM target): the prompt step launched, then the decode
  step on the next slot without the usual wait for the step before it (the two touch different
  sequences and KV blocks), and the time until both are done.

Wall times per step from the host (launch of the first to completion of the last), median of
--reps. The decodes read their tokens from the host (no dependence on the step before), so the
pair is independent by construction; the tokens themselves are not checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_step import STEPS_MAX, blocks_per_seq, build_runner  # noqa: E402


def batches(decodes: int, context: int, prompt: int):
    """(admit, step(i, with_decodes, with_prompt)): the first admits every decode row; step i
    decodes at context + i and/or prefills prompt p{i} (releasing p{i - 1})."""
    from vt.sampling import SamplingParams
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
    args = ap.parse_args()

    runner, _ = build_runner(args.preset, args.decodes, args.context, enforce_eager=True, prefill=args.prompt,
                             device=args.device)
    ops = runner.ops
    if args.device == "cuda":
        import cupy

        nsm = cupy.cuda.Device().attributes["MultiProcessorCount"]
        sync = cupy.cuda.Device().synchronize
    else:
        nsm, sync = 132, lambda: None
    eos = lambda _rid: ()  # noqa: E731
    admit, step = batches(args.decodes, args.context, args.prompt)
    runner.execute(admit, eos).result()

    caps = {"prompt": 0, "decode": 0}
    launch = runner._device_step

    def capped(st) -> None:  # the SM target of the step's kind, on its slot's handle, before its GEMMs
        if hasattr(ops, "gemm_handle"):
            sms = caps["prompt" if st.num_decodes < st.nseq else "decode"]
            ops.gemm_handle(st.slot).set_sm_count_target(sms)
        launch(st)

    runner._device_step = capped
    serial_after = ops.after
    # every timed call decodes one position further: the decode rows' blocks hold STEPS_MAX of them
    counter = iter(range(1, STEPS_MAX - 2))

    def timed(kinds: list[tuple[bool, bool]], side_by_side: bool) -> float:
        """Wall seconds of the steps `kinds` ((decodes, prompt) each) launched back to back."""
        i = next(counter)
        ops.after = (lambda _i, _j: None) if side_by_side else serial_after
        try:
            sync()
            t0 = time.perf_counter()
            handles = [runner.execute(step(i, d, p), eos) for d, p in kinds]
            for h in handles:
                h.result()
            return time.perf_counter() - t0
        finally:
            ops.after = serial_after

    def median_ms(kinds: list[tuple[bool, bool]], side_by_side: bool = False) -> float:
        timed(kinds, side_by_side)  # warm-up
        return 1e3 * statistics.median(timed(kinds, side_by_side) for _ in range(args.reps))

    print(f"{args.preset}: {args.decodes} decodes at {args.context} keys, a {args.prompt}-token prompt; "
          f"{nsm} SMs; ms a step, median of {args.reps}")
    mixed = median_ms([(True, True)])
    print(f"| mixed step | {mixed:.2f} |")
    print(f"| prompt alone | {median_ms([(False, True)]):.2f} |")
    print(f"| decodes alone | {median_ms([(True, False)]):.2f} |")
    print(f"| prompt then decodes, serial | {median_ms([(False, True), (True, False)]):.2f} |")
    for k in (int(x) for x in args.sms.split(",")):
        caps["prompt"], caps["decode"] = (nsm - k, k) if k else (0, 0)
        if k:
            print(f"| decodes alone, GEMMs on {k} SMs | {median_ms([(True, False)]):.2f} |")
            print(f"| prompt alone, GEMMs on {nsm - k} SMs | {median_ms([(False, True)]):.2f} |")
        both = median_ms([(False, True), (True, False)], side_by_side=True)
        print(f"| side by side, decode GEMMs on {k or 'any'} SMs | {both:.2f} | {mixed / both:.3f}x mixed |")
    caps["prompt"] = caps["decode"] = 0


if __name__ == "__main__":
    main()
