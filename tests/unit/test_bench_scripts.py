"""The bench scripts that run without a GPU (bench/step/prefill.py, bench/serving/peer_transformers.py,
bench/serving/structured_outputs.py, ...) run on CPU, as `python3 -m bench.<folder>.<script>`, and report
sane figures; the pure parts of the others are checked on hand-made inputs."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from unittest import mock

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(module: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`python3 -m bench.<module>` from the checkout's root, as bench/README.md runs the scripts."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", f"bench.{module}", *args], capture_output=True, text=True,
                          cwd=str(REPO_ROOT), env=env, timeout=timeout)


def load_script(module: str) -> ModuleType:
    """A bench script as a module: bench.<module>, imported as the scripts import each other."""
    return importlib.import_module(f"bench.{module}")


def test_prefill_tiny_numpy_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "prefill.json"
    proc = run_script("step.prefill", "--preset", "tiny", "--device", "numpy", "--prompt-lens", "64,256",
                      "--tokens", "256", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| tiny |")]
    assert len(table) == 2 and proc.stdout.startswith("| preset | prompt len |")
    rows = json.loads(out.read_text())
    assert [(r["prompt_len"], r["seqs"], r["tokens"]) for r in rows] == [(64, 4, 256), (256, 1, 256)]
    for r in rows:
        assert r["preset"] == "tiny"
        assert r["ms"] > 0 and r["ms_two_deep"] > 0 and r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["ms"] / 1e3))
        assert 0 < r["of_ceiling"] < 1
        assert r["of_ceiling"] == pytest.approx(r["tflops"] / 790.0)


def test_prefill_flops_count_matmuls_lm_head_and_causal_pairs() -> None:
    from vt.config import ModelConfig

    prefill = load_script("step.prefill")
    mc = ModelConfig.from_dict(dict(prefill.PRESETS["0.6b"], architectures=["Qwen3ForCausalLM"],
                                    max_position_embeddings=40960))
    h, i, q, kv, layers, vocab = 1024, 3072, 16 * 128, 8 * 128, 28, 151936
    params = layers * (h * (q + 2 * kv) + q * h + 2 * h * i + i * h)
    assert prefill.shape_of(1024, 8192) == (8, 8192) and prefill.shape_of(8192, 8192) == (1, 8192)
    assert prefill.shape_of(4096, 1000) == (1, 4096)
    pairs = 8 * 1024 * 1025 // 2
    expect = 2 * params * 8192 + 2 * h * vocab * 8 + 4 * 16 * 128 * pairs * layers
    assert prefill.prefill_flops(mc, 1024, 8) == pytest.approx(expect)


@pytest.fixture(scope="module")
def peer_cpu(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both modes of the peer script in one in-process run (torch is imported once per session
    anyway) on a tiny checkpoint."""
    for mod in ("torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed")
    from vt.model.make_model import make_model

    tmp = tmp_path_factory.mktemp("peer")
    model, out = make_model(tmp / "tiny", preset="tiny"), tmp / "peer.json"
    argv = ["peer_transformers", "--model", str(model), "--device", "cpu", "--mode", "both",
            "--batch", "3", "--input-len", "8", "--output-len", "5", "--json", str(out)]
    stdout = io.StringIO()
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(stdout):
        load_script("serving.peer_transformers").main()
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["batch"] == 3 and data["output_len"] == 5
    assert list(data["modes"]) == ["generate", "generate_batch"]
    for mode in data["modes"]:
        assert stdout.getvalue().count(f"transformers.{mode}:") == 1
    return data["modes"]


def test_peer_generate_on_cpu_counts_exact_lengths(peer_cpu: dict) -> None:
    res = peer_cpu["generate"]
    assert res["ok"] and res["exact_lengths"]
    assert res["output_tokens"] == 3 * 5 and res["min_len"] == res["max_len"] == 5
    assert res["output_tok_per_s"] > 0 and res["seconds"] > 0


def test_peer_generate_batch_gives_figures_or_a_one_line_reason(peer_cpu: dict) -> None:
    res = peer_cpu["generate_batch"]
    if not res["ok"]:
        assert res["error"] and "\n" not in res["error"]
        return
    assert res["exact_lengths"] and res["output_tokens"] == 3 * 5
    assert res["output_tok_per_s"] > 0 and 0 < res["seconds"] <= res["call_seconds"]


def test_step_profile_splits_steps_and_counts_busy_time_and_gaps() -> None:
    prof = load_script("step.step_profile")

    def k(name: str, ts: float, dur: float) -> dict:
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    # two steps of three kernels; a host-side event and the step boundary gap stay out
    trace = {"traceEvents": [
        k("rms_norm_k", 0, 2), k("nvjet_sm90_tst_64x64", 3, 10), k("attention_tc_d128_decode8", 14, 5),
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 50},
        k("rms_norm_k", 100, 4), k("nvjet_sm90_tst_64x64", 105, 10), k("attention_tc_d128_decode8", 116, 7),
    ]}
    kernels = prof.kernel_events(trace)
    steps = prof.split_steps(kernels, 3)
    assert [len(s) for s in steps] == [3, 3]
    s = prof.summarize(steps)
    assert s["kernels_per_step"] == 3
    assert s["busy_us"] == pytest.approx((17 + 21) / 2)  # median of two steps = mean
    assert s["gaps_us"] == pytest.approx((2 + 2) / 2)
    assert s["span_us"] == pytest.approx((19 + 23) / 2)
    names = {name: us for name, us, _ in s["rows"]}
    assert names["cublas:nvjet_sm90_tst_64x64"] == pytest.approx(10)
    assert names["attention_tc_d128_decode8"] == pytest.approx(6)


def test_step_profile_timeline_merges_overlapping_streams_and_counts_copies() -> None:
    prof = load_script("step.step_profile")
    ev = [dict(cat="gpu_memcpy", ts=0.0, dur=2.0), dict(cat="kernel", ts=1.0, dur=4.0),  # overlap
          dict(cat="kernel", ts=8.0, dur=2.0), dict(cat="cpu_op", ts=20.0, dur=5.0)]
    tl = prof.timeline(prof.device_events(dict(traceEvents=ev)))
    assert tl == dict(span_us=10.0, idle_us=3.0, copies=1, copy_us=2.0)
    assert prof.timeline([])["span_us"] == 0.0


def test_decode_roofline_counts_gemm_flops_only_where_they_outlast_the_weight_reads(tmp_path: Path) -> None:
    from vt.config import ModelConfig

    ds = load_script("step.decode_step")
    ds.write_config(tmp_path, "8b")
    mc = ModelConfig.from_dir(tmp_path)
    assert ds.roofline_seconds(mc, 64, 512) == pytest.approx(ds.floor_seconds(mc, 64, 512))
    # 8B at 256 rows: ~7.6e9 multiplied weights x 2 x 256 FLOPs outlast 16.4 GB of weight reads
    matmul = 36 * (4096 * 6144 + 4096 * 4096 + 2 * 4096 * 12288 + 12288 * 4096) + 151936 * 4096
    kv = 256 * 512 * 36 * 2 * 8 * 128 * 2 / ds.BANDWIDTH
    assert ds.roofline_seconds(mc, 256, 512) == pytest.approx(2 * matmul * 256 / ds.MATMUL_RATE + kv)
    assert ds.roofline_seconds(mc, 256, 512) > 1.1 * ds.floor_seconds(mc, 256, 512)


def test_decode_floor_counts_fp8_projections_and_kv_at_one_byte(tmp_path: Path) -> None:
    from vt.config import ModelConfig

    ds = load_script("step.decode_step")
    ds.write_config(tmp_path, "8b")
    mc = ModelConfig.from_dir(tmp_path)
    projections = 36 * (4096 * 6144 + 4096 * 4096 + 2 * 4096 * 12288 + 12288 * 4096)
    bf16 = ds.weight_bytes(mc)
    # the projections halve; embeddings, norms and lm_head stay two bytes an element
    assert ds.weight_bytes(mc, fp8=True) == bf16 - projections
    assert ds.kv_bytes(mc, 4, 100, kv8=True) * 2 == ds.kv_bytes(mc, 4, 100) == 4 * 100 * 36 * 2 * 8 * 128 * 2
    assert ds.floor_seconds(mc, 4, 100, True, True, 1e12) == pytest.approx(
        (bf16 - projections + 4 * 100 * 36 * 2 * 8 * 128) / 1e12)


def test_host_overhead_reports_server_cpu_per_token(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    # /proc counts CPU time in 10 ms ticks: 1024 tokens are tens of ms, never zero ticks
    proc = run_script("serving.host_overhead", "--concurrency", "8", "--num-prompts", "32", "--output-len",
                      "32", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "server CPU us/token" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert row["output_tok_s"] > 0 and row["cpu_us_per_token"] > 0
    # every phase ran: the fake device step still goes through scheduling, staging and output
    assert all(row[name] > 0 for name in ("schedule", "execute", "_collect", "_process"))


def test_structured_outputs_bench_runs_every_row_to_exact_lengths(tmp_path: Path) -> None:
    """bench/serving/structured_outputs.py on CPU: a 25% JSON-schema load, async on and off; guided
    requests run to max_tokens like the free ones, and one in four is guided."""
    from vt.model.make_model import make_model

    model = make_model(tmp_path / "tiny", preset="tiny")
    proc = run_script("serving.structured_outputs", "--model", str(model), "--device", "cpu", "--num-prompts",
                      "8", "--max-concurrency", "4", "--input-len", "8", "--output-len", "12", "--shares",
                      "25", "--out", str(tmp_path / "out"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "out" / "structured.json").read_text())
    assert [(r["share"], r["async"]) for r in data["rows"]] == [(25, True), (25, False)]
    for run in data["runs"]:
        assert run["requests"] == 8 and run["guided"] == 2 and run["output_tokens"] == 8 * 12
        assert run["output_throughput"] > 0 and run["tpot_guided_ms"] > 0 and run["tpot_free_ms"] > 0
    table = (tmp_path / "out" / "structured.md").read_text()
    assert "| 25% | on |" in table and "| 25% | off |" in table
    bench = load_script("serving.structured_outputs")
    assert [i for i in range(8) if bench.guided(i, 25)] == [3, 7]
    assert all(bench.guided(i, 100) for i in range(8)) and not any(bench.guided(i, 0) for i in range(8))


def test_structured_outputs_bench_on_an_emulated_device(tmp_path: Path) -> None:
    """--emulate-step-ms: the step sleeps instead of computing, and a guided row's token is one
    its mask allows, so every guided request (a grammar rejecting a token fails the run) goes
    through the masks and the second sampler pass, async on and off."""
    from vt.model.make_model import make_model

    model = make_model(tmp_path / "tiny", preset="tiny")
    proc = run_script("serving.structured_outputs", "--model", str(model), "--device", "cpu", "--num-prompts",
                      "8", "--max-concurrency", "8", "--input-len", "8", "--output-len", "16", "--shares",
                      "100", "--emulate-step-ms", "2", "--out", str(tmp_path / "out"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "out" / "structured.json").read_text())
    for run in data["runs"]:
        assert run["guided"] == 8 and run["output_tokens"] == 8 * 16
        assert run["mean_step_ms"] >= 2.0  # the emulated step's own time, at least
    assert "device emulated (2.0 ms a step" in (tmp_path / "out" / "structured.md").read_text()


def test_emulated_device_runs_jobs_as_a_stream_would() -> None:
    """A job starts when launched or when the previous one ends, whichever is later; when the
    worker got to it does not move it."""
    clock = load_script("serving.emulated_device").DeviceClock()
    t0 = time.monotonic()
    clock.launched = t0
    clock.run(0.002)
    assert clock.end == pytest.approx(t0 + 0.002, abs=1e-9)
    clock.launched = t0 + 0.001  # launched while the first ran: queued behind it
    clock.run(0.002)
    assert clock.end == pytest.approx(t0 + 0.004, abs=1e-9)
    clock.launched = clock.end + 0.003  # launched after the device went idle
    clock.run(0.0)
    assert clock.end == pytest.approx(t0 + 0.007, abs=1e-9) and time.monotonic() >= clock.end


def test_emulated_device_picks_a_token_the_mask_allows() -> None:
    allowed_token = load_script("serving.emulated_device").allowed_token
    rng = np.random.default_rng(0)
    for _ in range(200):
        words = np.zeros(int(rng.integers(1, 40)), dtype=np.int32)
        allowed = rng.choice(len(words) * 32, size=int(rng.integers(0, 4)), replace=False)
        for t in allowed:
            words[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        start = int(rng.integers(0, 100))
        tok = allowed_token(words, start)
        if not len(allowed):
            assert tok == -1
            continue
        # the first allowed token from word `start` on, wrapping around
        order = sorted(allowed, key=lambda t: ((t // 32 - start) % len(words), t))
        assert tok == order[0]


def test_attn_tilings_serves_the_fastest_tiling_that_agrees() -> None:
    """bench/kernels/attn_tilings.py --best: a faster tiling whose output drifts from the default's is
    never chosen; among the agreeing ones the best geometric-mean speed-up at 8B's heads wins."""
    best_tiling = load_script("kernels.attn_tilings").best_tiling
    rows = [
        {"hq": 32, "tiling": "r64", "speedup": 1.0, "rel_diff": 0.0},
        {"hq": 32, "tiling": "wg", "speedup": 2.5, "rel_diff": 0.004},
        {"hq": 32, "tiling": "wg", "speedup": 1.6, "rel_diff": 0.003},
        {"hq": 32, "tiling": "wgp", "speedup": 3.0, "rel_diff": 0.4},  # fast and wrong
        {"hq": 32, "tiling": "w8", "speedup": 0.9, "rel_diff": 0.0},
        {"hq": 16, "tiling": "wg", "speedup": 0.5, "rel_diff": 0.0},  # other heads: not in the score
    ]
    assert best_tiling(rows) == "wg"
    rows[3]["rel_diff"] = 0.001
    assert best_tiling(rows) == "wgp"
    assert best_tiling([r for r in rows if r["tiling"] in ("r64", "w8")]) == "r64"
    assert best_tiling([{"hq": 32, "tiling": "w8", "speedup": 1.2, "rel_diff": float("nan")},
                        {"hq": 32, "tiling": "r64", "speedup": 1.0, "rel_diff": 0.0}]) == "r64"


def test_step_trace_summary_groups_steps_by_what_they_computed(tmp_path: Path) -> None:
    summary = load_script("serving.step_trace_summary")

    def step(i: int, ms: float, decodes: int, prompt: int) -> dict:
        return {"step": i, "launch": i * 0.1, "start": i * 0.1, "end": i * 0.1 + ms / 1e3, "device_ms": ms,
                "seqs": decodes + (prompt > 0), "tokens": decodes + prompt, "decodes": decodes,
                "prompt_tokens": prompt, "max_context": 100}

    steps = [step(0, 50.0, 0, 2048), step(1, 40.0, 100, 1948), step(2, 20.0, 10, 500), step(3, 10.0, 200, 0),
             step(4, 10.0, 100, 0)]
    steps[4] = {**steps[4], "start": steps[3]["end"] + 0.002, "end": steps[3]["end"] + 0.012}
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in steps))
    lines = summary.summarize(summary.load(trace), budget=2048)
    assert lines[0].startswith("5 steps, device 0.13 s")
    # gaps of 50, 60 and 80 ms are idle; the 2 ms one is the host's
    assert lines[0].endswith("1 steps launched after the previous one ended, 0.00 s in those gaps; "
                             "3 idle gaps of 50 ms or more, 0.19 s")
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines if line.startswith("| ")}
    assert rows["prompt, budget full"][1:5] == ["2", "0.09", "69%", "45.00"]
    assert rows["prompt, budget < 90%"][1] == "1"
    assert rows["decode only"][1:6] == ["2", "0.02", "15%", "10.00", "150"]


def test_schedule_sim_reproduces_the_measured_steps_and_prices_pacing() -> None:
    """The cost model against the H100 step traces it was fitted to (bench/RESULTS.md: 8000/64 at
    budget 2048 served 207.5 tok/s in 304 steps, 175 of them decode-only; with prompts paced at
    a floor of 512 and no rounding to the layer graph sizes, 198.5), and pacing as the scheduler now
    does it taking decode-only steps out of that row."""
    sim = load_script("serving.schedule_sim")
    from vt.sched.scheduler import SchedulerConfig

    def row(**kw):
        cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, block_size=16, num_blocks=4100,
                              **kw)
        return sim.run_row(8000, 64, 32, 8, cfg, sim.StepCost())

    off = row()
    assert 200 < off.out_tok_s < 215 and 280 < off.steps < 320 and 150 < off.decode_only_steps < 190
    unrounded = row(prefill_pacing=True, pacing_floor=512)
    assert 190 < unrounded.out_tok_s < off.out_tok_s
    paced = row(prefill_pacing=True, step_sizes=tuple(n for n in sim.LAYER_GRAPH_SIZES if n <= 2048))
    assert paced.out_tok_s > off.out_tok_s * 1.02 and paced.decode_only_steps < off.decode_only_steps / 2
    assert paced.mean_ttft_ms < off.mean_ttft_ms * 1.2


def test_overlap_probe_runs_its_steps_on_the_numpy_backend() -> None:
    """The probe's steps (mixed, alone, side by side at two SM targets) run end to end on the CPU;
    the GPU run is the one whose times mean anything."""
    r = run_script("probes.overlap_probe", "--preset", "tiny", "--device", "cpu", "--decodes", "8",
                   "--context", "64", "--prompt", "40", "--sms", "0,16", "--reps", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 8 and rows[-1].startswith("| side by side, decode GEMMs on 16 SMs")


def _fake_cupy(clock: list[float]) -> ModuleType:
    """A cupy whose events read `clock` (ms) when recorded, for timing code without a GPU."""
    class Event:
        def record(self, stream=None) -> None:
            self.at = clock[0]

        def synchronize(self) -> None:
            pass

    cuda = ModuleType("cupy.cuda")
    cuda.Event = Event
    cuda.get_elapsed_time = lambda start, end: end.at - start.at
    cupy = ModuleType("cupy")
    cupy.cuda = cuda
    return cupy


def test_graph_timer_gives_the_median_replay_per_call() -> None:
    """bench/graph_timing.median_per_call: seconds a call, the median over replays of the graph's
    time divided by its calls (replays of 10, 40 and 20 ms holding 10 calls: 2 ms a call)."""
    clock = [0.0]
    durations = iter([10.0, 40.0, 20.0])

    def replay() -> None:
        clock[0] += next(durations)

    with mock.patch.dict(sys.modules, {"cupy": _fake_cupy(clock)}):
        timing = importlib.import_module("bench.graph_timing")
        assert timing.median_per_call(None, replay, calls=10, replays=3) == pytest.approx(2e-3)
