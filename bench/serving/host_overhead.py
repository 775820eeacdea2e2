"""Host CPU a generated token costs the server, with the device step taken away.

    python3 -m bench.serving.host_overhead --concurrency 256 --num-prompts 1024 --output-len 128

The server is `vt serve` on the built-in demo model (CPU backend) whose device step only writes
token ids into the step's pinned output buffer, so what remains is the work of the event loop's
thread: HTTP, the scheduler, staging, detokenizing, streaming. It is driven by `vt bench`
(keep-alive clients, streaming completions, ignore_eos) and its CPU time is read from
/proc/PID/stat around the run (Linux). On a GPU this work overlaps the device steps (async
scheduling), so it bounds throughput once it is longer than a step: at batch B, B times the
figure here against the decode step time.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the server child imports this checkout's vt and bench
PHASES = (("vt.sched.scheduler", "Scheduler", "schedule"), ("vt.runner.runner", "ModelRunner", "execute"),
          ("vt.runner.runner", "ModelRunner", "_collect"), ("vt.engine.engine", "AsyncEngine", "_process"))


def _serve(port: int, max_num_seqs: int, phases_path: str) -> int:
    """The server process: `vt serve` with the device step replaced and the phases timed."""
    import importlib

    import numpy as np

    from vt.launch import cli
    from vt.runner import runner

    init = runner.ModelRunner.__init__

    def patched_init(self: runner.ModelRunner, *a: object, **k: object) -> None:
        init(self, *a, **k)

        def device_step(st: object, rn: runner.ModelRunner = self) -> None:
            # Valid, varying token ids; ignore_eos keeps every request to its full length.
            rn.slots[st.slot].out.ids[: st.nseq] = (np.arange(st.nseq) * 7 + rn.step_id) % 900 + 5

        self._device_step = device_step

    runner.ModelRunner.__init__ = patched_init
    spent: Counter = Counter()

    def timed(cls: type, name: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*a: object, **k: object) -> object:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t

        setattr(cls, name, wrapper)

    for module, cls, name in PHASES:
        timed(getattr(importlib.import_module(module), cls), name)
    atexit.register(lambda: Path(phases_path).write_text(json.dumps(spent)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return cli.main(["serve", "--port", str(port), "--device", "cpu", "--max-num-seqs", str(max_num_seqs),
                     "--max-num-batched-tokens", "8192", "--max-model-len", "1024"])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(args: argparse.Namespace) -> dict[str, float]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        phases = Path(tmp) / "phases.json"
        out = Path(tmp) / "bench.json"
        path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
        env = dict(os.environ, PYTHONPATH=path)
        server = subprocess.Popen([sys.executable, "-m", "bench.serving.host_overhead", "--serve", str(port),
                                   "--max-num-seqs", str(args.max_num_seqs), "--phases", str(phases)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the server did not start: {server.stderr.read()[-2000:]}") from None
                    time.sleep(0.2)
            cpu0 = _cpu_seconds(server.pid)
            bench = subprocess.run(
                [sys.executable, "-m", "vt", "bench", "--base-url", f"http://127.0.0.1:{port}",
                 "--no-progress", "--num-prompts", str(args.num_prompts), "--max-concurrency",
                 str(args.concurrency), "--input-len", str(args.input_len), "--output-len",
                 str(args.output_len), "--ignore-eos",
                 "--json", str(out)], env=env, capture_output=True, text=True)
            cpu1 = _cpu_seconds(server.pid)
            if bench.returncode != 0:
                raise RuntimeError(f"vt bench failed: {bench.stderr[-2000:]}")
        finally:
            server.terminate()
            server.wait(timeout=60)
        summary = json.loads(out.read_text())["summary"]
        spent = json.loads(phases.read_text()) if phases.exists() else {}
    tokens = summary["total_output_tokens"]
    row = {"output_tok_s": summary["output_throughput"], "cpu_us_per_token": (cpu1 - cpu0) / tokens * 1e6}
    for _, _, name in PHASES:
        row[name] = spent.get(name, 0.0) / tokens * 1e6
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phases", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        return _serve(args.serve, args.max_num_seqs, args.phases)
    rows = [run_once(args) for _ in range(args.repeats)]
    names = [name for _, _, name in PHASES]
    print("| run | output tok/s | server CPU us/token | " + " | ".join(names) + " |")
    print("| ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['output_tok_s']:.0f} | {r['cpu_us_per_token']:.1f} | "
              + " | ".join(f"{r[n]:.1f}" for n in names) + " |")
    best = min(rows, key=lambda r: r["cpu_us_per_token"])
    print(f"least server CPU per token: {best['cpu_us_per_token']:.1f} us (phases: us per token)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
