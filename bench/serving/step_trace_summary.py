"""Where a serving run's device time went, from `vt serve --step-trace FILE`:

    python3 -m bench.serving.step_trace_summary FILE [FILE ...]

Steps are grouped by what they computed: decode-only steps, and steps with prompt tokens by how
full of the token budget they were. For each group: steps, device seconds and share, mean step
ms, mean tokens / decodes / prompt tokens, and device microseconds per token. The first and last
seconds of a closed-loop benchmark (ramp-up, drain) are where the groups differ most, so the
run is also cut into tenths of its steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

IDLE_GAP_S = 0.05  # a gap this long is the load's (no request to run), not the host's


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def group_of(step: dict, budget: int) -> str:
    if step["prompt_tokens"] == 0:
        return "decode only"
    fill = step["tokens"] / budget
    return "prompt, budget full" if fill >= 0.9 else "prompt, budget < 90%"


def summarize(steps: list[dict], budget: int) -> list[str]:
    total = sum(s["device_ms"] for s in steps) / 1e3
    span = (steps[-1]["end"] - steps[0]["launch"]) if steps else 0.0
    # The device waited: a step launched after the one before it had ended. A short gap is the
    # host's (work was there, the launch came late); a long one is the load's (no request came,
    # as between a benchmark's phases).
    gaps = [b["start"] - a["end"] for a, b in zip(steps, steps[1:]) if b["start"] > a["end"]]
    waits = [g for g in gaps if g < IDLE_GAP_S]
    idle = [g for g in gaps if g >= IDLE_GAP_S]
    out = [f"{len(steps)} steps, device {total:.2f} s of a {span:.2f} s span, budget {budget} tokens; "
           f"{len(waits)} steps launched after the previous one ended, {sum(waits):.2f} s in those gaps; "
           f"{len(idle)} idle gaps of {IDLE_GAP_S * 1e3:.0f} ms or more, {sum(idle):.2f} s",
           "| group | steps | device s | share | mean ms | tokens | decodes | prompt tok | us/token |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    groups: dict[str, list[dict]] = {}
    for s in steps:
        groups.setdefault(group_of(s, budget), []).append(s)
    for name in ("prompt, budget full", "prompt, budget < 90%", "decode only"):
        g = groups.get(name, [])
        if not g:
            continue
        sec = sum(s["device_ms"] for s in g) / 1e3
        tok = sum(s["tokens"] for s in g)
        out.append(f"| {name} | {len(g)} | {sec:.2f} | {sec / max(total, 1e-9):.0%} | "
                   f"{1e3 * sec / len(g):.2f} | "
                   f"{tok / len(g):.0f} | {sum(s['decodes'] for s in g) / len(g):.0f} | "
                   f"{sum(s['prompt_tokens'] for s in g) / len(g):.0f} | {1e6 * sec / max(tok, 1):.1f} |")
    out.append("| tenth of the steps | device s | mean ms | tokens | decodes | prompt tok |")
    out.append("|---|---:|---:|---:|---:|---:|")
    n = len(steps)
    for i in range(10):
        part = steps[i * n // 10:(i + 1) * n // 10]
        if not part:
            continue
        sec = sum(s["device_ms"] for s in part) / 1e3
        out.append(f"| {i + 1} | {sec:.2f} | {1e3 * sec / len(part):.2f} | "
                   f"{sum(s['tokens'] for s in part) / len(part):.0f} | "
                   f"{sum(s['decodes'] for s in part) / len(part):.0f} | "
                   f"{sum(s['prompt_tokens'] for s in part) / len(part):.0f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--budget", type=int, default=None,
                    help="the server's --max-num-batched-tokens (default: the largest step seen)")
    args = ap.parse_args()
    for path in args.traces:
        steps = load(path)
        budget = args.budget or max((s["tokens"] for s in steps), default=1)
        print(f"## {path.name}")
        print("\n".join(summarize(steps, budget)))
        print()


if __name__ == "__main__":
    main()
