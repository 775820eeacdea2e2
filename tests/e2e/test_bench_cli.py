"""`vt bench` end to end on CPU: real servers started by the benchmark, or one already running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import start_server

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = (
    "successful_requests", "failed_requests", "duration_s", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "peak_output_throughput", "peak_concurrent_requests",
    "total_token_throughput",
    *(f"{m}_{p}_ms" for m in ("ttft", "tpot", "itl", "e2el") for p in ("mean", "median", "p90", "p99")),
    "request_goodput", "gpu_steps", "mean_step_time_ms", "gpu_idle_fraction",
)


def vt_bench(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "vt", "bench", *args], capture_output=True, text=True,
                          cwd=str(REPO_ROOT), env=env, timeout=timeout)


def test_compare_async_writes_both_arms_and_a_plot(tiny_model_dir: Path, tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    proc = vt_bench("--model", str(tiny_model_dir), "--device", "cpu", "--compare-async",
                    "--num-prompts", "8", "--input-len", "16", "--output-len", "8",
                    "--goodput", "ttft:60000", "--json", str(out_json), "--plot", str(out_png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    assert "Mean TTFT (ms):" in proc.stdout and "P99 ITL (ms):" in proc.stdout
    assert "on/off" in proc.stdout and "greedy outputs identical:" in proc.stdout
    assert "8/8" in proc.stderr  # the progress bar reached the end
    assert "\r" not in proc.stderr  # stderr is a pipe here: progress lines, no redrawn bar

    data = json.loads(out_json.read_text())
    assert set(data["arms"]) == {"async_on", "async_off"}
    assert set(FIGURES) <= set(data["ratio_on_off"])
    assert isinstance(data["outputs_identical"], bool)
    for name, arm in data["arms"].items():
        figures = arm["figures"]
        missing = [k for k in FIGURES if k not in figures]
        assert not missing, f"{name} lacks {missing}"
        assert figures["successful_requests"] == 8 and figures["failed_requests"] == 0
        assert figures["total_input_tokens"] == 8 * 16  # exact prompt lengths
        assert figures["total_output_tokens"] == 8 * 8  # ignore_eos: exact output lengths
        assert figures["request_goodput"] == pytest.approx(figures["request_throughput"])
        assert figures["gpu_steps"] > 0 and figures["mean_step_time_ms"] > 0  # read from /metrics
        assert 0.0 <= figures["gpu_idle_fraction"] <= 1.0
        for key in FIGURES:
            if key != "failed_requests":
                assert figures[key] is not None, f"{name}: {key} is missing a value"
        (run,) = arm["runs"]
        assert run["server"]["flags"][-1] == ("--async-scheduling" if name == "async_on"
                                              else "--no-async-scheduling")
        requests = run["requests"]
        assert sorted(r["index"] for r in requests) == list(range(8))
        for r in requests:
            assert r["success"] and r["error"] == ""
            assert r["input_tokens"] == 16 and r["output_tokens"] == 8
            assert r["start"] <= r["first_token"] <= r["end"]
            assert r["chunk_times"] == sorted(r["chunk_times"]) and r["chunk_times"][0] == r["first_token"]
    # same seed -> same prompts in both arms: same prompt lengths, and texts compared per prompt
    on = {r["index"]: r for r in data["arms"]["async_on"]["runs"][0]["requests"]}
    off = {r["index"]: r for r in data["arms"]["async_off"]["runs"][0]["requests"]}
    differ = sorted(i for i in on if on[i]["text"] != off[i]["text"])
    assert differ == data["mismatched_prompts"]

    assert out_png.read_bytes()[:8] == PNG_SIGNATURE


@pytest.fixture(scope="module")
def vt_server(tiny_model_dir: Path):
    # priority scheduling: the runs below send priorities other than 0, which fcfs refuses
    handle = start_server(tiny_model_dir, "--scheduling-policy", "priority")
    yield handle
    handle.stop()


def test_bench_against_running_server(vt_server, tmp_path: Path) -> None:
    out_json = tmp_path / "run.json"
    proc = vt_bench("--base-url", vt_server.url, "--num-prompts", "5", "--input-len", "12",
                    "--output-len", "4", "--request-rate", "50", "--max-concurrency", "2",
                    "--priority-mix", "0:0.4", "--no-progress", "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    figures = data["figures"]
    assert figures["successful_requests"] == 5
    assert figures["total_input_tokens"] == 5 * 12  # prompts built from the server's /tokenize ids
    assert figures["peak_concurrent_requests"] <= 2
    assert sorted(r["priority"] for r in data["requests"]) == [0, 0, 1, 1, 1]


def test_a_vllm_bench_serve_command_line_runs_unchanged(vt_server, tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    """vLLM's flags with vLLM's meanings against a running server, vLLM's result file out."""
    host, port = vt_server.url.removeprefix("http://").split(":")
    proc = vt_bench("--backend", "vllm", "--host", host, "--port", port, "--model", str(tiny_model_dir),
                    "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4",
                    "--random-prefix-len", "4", "--random-range-ratio", "0.0", "--num-prompts", "6",
                    "--request-rate", "100", "--burstiness", "0.5", "--max-concurrency", "3", "--ignore-eos",
                    "--seed", "1", "--temperature", "0", "--top-p", "0.9", "--top-k", "5",
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                    "--save-result", "--result-dir", str(tmp_path / "results"), "--result-filename", "r.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "P50 TTFT (ms):" in proc.stdout and "P99 E2EL (ms):" in proc.stdout
    assert "Maximum request concurrency:             3" in proc.stdout
    assert "GPU idle fraction:" in proc.stdout  # vt's /metrics measures it
    assert "6/6 requests done" in proc.stderr and "\r" not in proc.stderr + proc.stdout
    result = json.loads((tmp_path / "results" / "r.json").read_text())
    assert (result["completed"], result["failed"], result["num_prompts"]) == (6, 0, 6)
    assert result["total_input_tokens"] == 6 * (4 + 16)   # the prefix before every random prompt
    assert result["total_output_tokens"] == 6 * 4
    assert (result["request_rate"], result["burstiness"], result["max_concurrency"]) == (100.0, 0.5, 3)
    assert result["backend"] == "vllm" and result["model_id"] == str(tiny_model_dir)
    assert result["max_concurrent_requests"] <= 3
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for part in ("mean", "median", "std", "p50", "p99"):
            assert result[f"{part}_{metric}_ms"] is not None, f"{part}_{metric}_ms"
    assert result["p50_ttft_ms"] <= result["p99_ttft_ms"]
    assert 0.0 <= result["gpu_idle_fraction"] <= 1.0


def write_sharegpt(path: Path) -> list[tuple[str, str]]:
    """A small ShareGPT file: three usable conversations, one prompt too short, one single turn."""
    pairs = [("Tell me a story about a quick brown fox that jumps over the lazy dog.",
              "Once upon a time a fox lived near a park in Paris."),
             ("Name three cities such as Paris, Tokyo and Lagos, with a number like 42.",
              "Paris, Tokyo and Lagos are three cities."),
             ("What do serving benchmarks measure when they stream every token back?",
              "How long each token took, and how many arrive per second.")]
    entries = [{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r},
                                                {"from": "human", "value": "And then?"}]}
               for i, (p, r) in enumerate(pairs)]
    short = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello, how can I help you?"}]
    entries.insert(1, {"id": "short", "conversations": short})
    entries.append({"id": "one", "conversations": [{"from": "human", "value": "A question with no reply"}]})
    path.write_text(json.dumps(entries))
    return pairs


def test_sharegpt_file_prompts_and_reply_lengths(vt_server, tiny_model_dir: Path, tmp_path: Path) -> None:
    from vt.text.tokenizer import Tokenizer

    pairs = write_sharegpt(tmp_path / "sharegpt.json")
    tok = Tokenizer.from_dir(tiny_model_dir)
    want = sorted((len(tok.encode(p)), len(tok.encode(r))) for p, r in pairs)
    assert len(tok.encode("Hi")) < 4  # the short entry is one vLLM's filter drops
    out = tmp_path / "run.json"
    # no --model: the server's /tokenize counts the conversations
    proc = vt_bench("--base-url", vt_server.url, "--dataset-name", "sharegpt", "--dataset-path",
                    str(tmp_path / "sharegpt.json"), "--num-prompts", "3", "--ignore-eos", "--disable-tqdm",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    requests = json.loads(out.read_text())["requests"]
    assert all(r["success"] for r in requests)
    # every usable conversation once: its first turn as the prompt, its reply's length as max_tokens
    assert sorted((r["input_tokens"], r["output_tokens"]) for r in requests) == want

    # the chat endpoint, the tokenizer read here (--model), a fixed output length
    proc = vt_bench("--base-url", vt_server.url, "--backend", "openai-chat", "--model", str(tiny_model_dir),
                    "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sharegpt.json"),
                    "--num-prompts", "5", "--sharegpt-output-len", "3", "--ignore-eos", "--disable-tqdm",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    requests = json.loads(out.read_text())["requests"]
    assert len(requests) == 5 and all(r["success"] and r["output_tokens"] == 3 for r in requests)
    assert all(len(r["chunk_times"]) == 3 for r in requests)  # the role chunk is no token
    # the chat template wraps each prompt: more tokens than the prompt alone
    assert min(r["input_tokens"] for r in requests) > min(n for n, _ in want)


@pytest.mark.parametrize(("args", "message"), [
    (["--request-rate", "-1"], "--request-rate: must be positive or 'inf'"),
    (["--request-rate", "fast"], "--request-rate: not a number"),
    (["--num-prompts", "0"], "--num-prompts: must be at least 1"),
    (["--range-ratio", "1.5"], "--range-ratio: must be in [0, 1)"),
    (["--goodput", "ttft:abc"], "is not a number of milliseconds"),
    (["--goodput", "latency:5"], "--goodput expects KEY:MS"),
    (["--priority-mix", "0:0.8", "1:0.5"], "--priority-mix shares add up to more than 1"),
    (["--compare-async", "--base-url", "http://127.0.0.1:9"], "--compare-async starts its own servers"),
    (["--model", "/nonexistent/model"], "not a checkpoint folder"),
])
def test_bad_flags_exit_nonzero_with_a_clear_message(args: list[str], message: str) -> None:
    proc = vt_bench(*args, timeout=60.0)
    assert proc.returncode != 0
    assert "vt bench" in proc.stderr and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_server_is_a_clear_error() -> None:
    proc = vt_bench("--base-url", "http://127.0.0.1:9", "--num-prompts", "1", timeout=60.0)
    assert proc.returncode == 1
    assert "cannot reach the server" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_client_reuses_keep_alive_connections(vt_server) -> None:
    """Requests in turn share one connection, an error response (400) included; every stream
    is read whole before its connection is reused."""
    import asyncio

    from vt.bench.client import ConnectionPool, Endpoint, http_json, stream_completion
    from vt.bench.stats import RequestRecord

    async def run() -> tuple[list[RequestRecord], int]:
        pool = ConnectionPool(Endpoint.from_url(vt_server.url))
        _, models = await http_json(pool.ep, "GET", "/v1/models")
        model = models["data"][0]["id"]
        recs = [RequestRecord(index=i, input_tokens=3) for i in range(5)]
        try:
            for i, rec in enumerate(recs):
                payload = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "stream": True,
                           "ignore_eos": True, "stream_options": {"include_usage": True}}
                if i == 2:
                    payload["max_tokens"] = -1  # rejected with a 400
                await stream_completion(pool.ep, payload, rec, 0.0, pool)
        finally:
            await pool.close()
        return recs, pool.opened

    recs, opened = asyncio.run(run())
    assert [r.success for r in recs] == [True, True, False, True, True], [r.error for r in recs]
    assert recs[2].error.startswith("HTTP 400")
    assert all(r.output_tokens == 4 for i, r in enumerate(recs) if i != 2)
    assert opened == 1
