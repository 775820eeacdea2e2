"""What `vt bench` prints and saves: vLLM's result file (field names, hand-worked figures, file name),
server figures shown only where the server's /metrics measured them, progress that writes no '\\r'
into a file, and --plot without matplotlib naming an install that works."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import threading
from datetime import datetime
from pathlib import Path

import orjson
import pytest

from tests.unit.test_bench_vllm_datasets import config
from vt.bench import run as bench
from vt.bench.progress import Progress
from vt.bench.report import format_summary
from vt.bench.results import RunResult, result_path, save_vllm_result, vllm_result
from vt.bench.stats import GpuStats, RequestRecord, summarize

# ---------------------------------------------------------------- vLLM's result file


def records() -> list[RequestRecord]:
    # TTFTs 0.1, 0.2, 0.3 s; latencies 0.4, 0.6, 0.9 s; 4, 3, 1 tokens; one failure
    return [
        RequestRecord(index=0, input_tokens=10, start=0.0, first_token=0.1, chunk_times=[0.1, 0.2, 0.3, 0.4],
                      end=0.4, output_tokens=4, success=True, text="abcd"),
        RequestRecord(index=1, input_tokens=20, start=0.1, first_token=0.3, chunk_times=[0.3, 0.5, 0.7],
                      end=0.7, output_tokens=3, success=True, text="xyz"),
        RequestRecord(index=2, input_tokens=30, start=0.1, first_token=0.4, chunk_times=[0.4], end=1.0,
                      output_tokens=1, success=True, text="q"),
        RequestRecord(index=3, input_tokens=40, start=0.2, end=0.25, error="HTTP 503: busy"),
    ]


def test_vllm_result_fields_and_figures() -> None:
    cfg = config(num_prompts=4, request_rate=2.0, burstiness=0.5, max_concurrency=3, model_hint="Org/M",
                 percentile_metrics=("ttft", "tpot"), metric_percentiles=(50.0, 99.9), save_detailed=True,
                 metadata={"tp": "1"}, goodput_slo_ms={"ttft": 250.0})
    summary = summarize(records(), 2.0, cfg.goodput_slo_ms, None, cfg.metric_percentiles)
    out = vllm_result(RunResult("bench", records(), 2.0, summary, {"model": "served"}), cfg, "20260102-0304")
    assert (out["backend"], out["endpoint_type"], out["date"]) == ("openai", "openai", "20260102-0304")
    assert (out["model_id"], out["tp"]) == ("Org/M", "1")  # --model as given, --metadata pairs
    assert (out["request_rate"], out["burstiness"], out["max_concurrency"]) == (2.0, 0.5, 3)
    assert (out["completed"], out["failed"], out["num_prompts"]) == (3, 1, 4)
    assert (out["total_input_tokens"], out["total_output_tokens"]) == (60, 8)
    assert out["duration"] == 2.0
    assert out["request_throughput"] == pytest.approx(1.5)
    assert out["request_goodput"] == pytest.approx(1.0)  # TTFT 100 and 200 ms meet 250 ms
    assert out["output_throughput"] == pytest.approx(4.0)
    assert out["total_token_throughput"] == pytest.approx(34.0)
    assert out["mean_ttft_ms"] == pytest.approx(200.0) and out["median_ttft_ms"] == pytest.approx(200.0)
    assert out["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)  # population std of 100, 200, 300
    assert out["p50_ttft_ms"] == pytest.approx(200.0)
    assert out["p99.9_ttft_ms"] == pytest.approx(200.0 + 0.998 * 100.0)
    assert out["mean_tpot_ms"] == pytest.approx(150.0)  # 0.3 / 3 and 0.4 / 2; one token has none
    assert "mean_itl_ms" not in out and "mean_e2el_ms" not in out  # not asked for
    assert out["latencies"] == pytest.approx([0.4, 0.6, 0.9, 0.0])
    assert out["ttfts"] == pytest.approx([0.1, 0.2, 0.3, 0.0])
    assert out["itls"][0] == pytest.approx([0.1, 0.1, 0.1]) and out["itls"][3] == []
    assert out["output_lens"] == [4, 3, 1, 0] and out["input_lens"] == [10, 20, 30, 40]
    assert out["errors"][3] == "HTTP 503: busy"
    assert "gpu_idle_fraction" not in out  # not measured: not written


def test_saved_result_goes_under_result_dir_named_by_date(tmp_path: Path) -> None:
    cfg = config(request_rate=4.0, result_dir=str(tmp_path / "new"), save_result=True)
    run = RunResult("bench", records(), 2.0, summarize(records(), 2.0), {"model": "/ckpt/tiny"})
    path = save_vllm_result(run, cfg, now=datetime(2026, 1, 2, 3, 4, 5))
    assert path == tmp_path / "new" / "openai-4.0qps-tiny-20260102-030405.json"
    saved = json.loads(path.read_text())
    assert saved["date"] == "20260102-030405" and saved["completed"] == 3
    assert saved["model_id"] == "/ckpt/tiny"  # no --model given: the served name, as vLLM


def test_result_file_name_is_vllms() -> None:
    cfg = config(request_rate=float("inf"), max_concurrency=16, label=None)
    name = "openai-infqps-concurrency16-Qwen3-8B-20260102-030405.json"
    assert str(result_path(cfg, "Org/Qwen3-8B", "20260102-030405")) == name
    cfg = config(request_rate=8.0, backend="openai-chat", endpoint="/v1/chat/completions")
    assert str(result_path(cfg, "m", "d")) == "openai-chat-8.0qps-m-d.json"
    cfg = config(result_filename="mine.json", label="x")
    assert str(result_path(cfg, "m", "d")) == "mine.json"


# ---------------------------------------------------------------- server figures


def test_server_figures_are_printed_only_where_measured() -> None:
    s = summarize(records(), 2.0)
    assert "GPU idle fraction" not in format_summary(s) and "Server steps" not in format_summary(s)
    s.gpu = GpuStats(steps=10, mean_step_time_ms=2.5, gpu_idle_seconds=None, gpu_idle_fraction=None)
    text = format_summary(s)
    assert "Engine steps:" in text and "Mean step time (ms):" in text and "GPU idle fraction" not in text
    s.gpu = GpuStats(steps=10, mean_step_time_ms=2.5, gpu_idle_seconds=0.5, gpu_idle_fraction=0.25)
    assert "GPU idle fraction:                       0.2500" in format_summary(s)


class FakeServer:
    """An OpenAI-style server on loopback with no /metrics (as a server without vt's counters):
    /v1/models, /tokenize, /detokenize and streamed /v1/completions and /v1/chat/completions."""

    def __init__(self, tokens: tuple[int, ...] = (5, 6, 7, 8, 9)) -> None:
        self.bodies: list[dict] = []
        self.tokens = list(tokens)  # what /tokenize answers for any text
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        method, path = head.split()[:2]
        sizes = [ln.split(":")[1] for ln in head.split("\r\n") if ln.lower().startswith("content-length")]
        length = int(sizes[0]) if sizes else 0
        body = orjson.loads(await reader.readexactly(length)) if length else {}
        if path == "/v1/models":
            self._json(writer, 200, {"data": [{"id": "fake", "max_model_len": 4096}]})
        elif path == "/tokenize":
            self._json(writer, 200, {"tokens": self.tokens})
        elif path == "/detokenize":
            self._json(writer, 200, {"prompt": " ".join(map(str, body["tokens"]))})
        elif path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
            self.bodies.append(body)
            chat = path.endswith("chat/completions")
            n = body.get("max_completion_tokens" if chat else "max_tokens", 1)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            token = {"delta": {"content": "t"}} if chat else {"text": "t"}
            chunks = ([role] if chat else []) + [{"choices": [{"index": 0, **token}]} for _ in range(n)]
            chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}})
            for c in chunks:
                writer.write(b"data: " + orjson.dumps(c) + b"\n\n")
                await writer.drain()
                await asyncio.sleep(0.001)
            writer.write(b"data: [DONE]\n\n")
        else:
            self._json(writer, 404, {"error": {"message": "not found"}})
        await writer.drain()
        writer.close()

    @staticmethod
    def _json(writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        data = orjson.dumps(obj)
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (status, len(data), data))


@pytest.fixture
def fake_server():
    server = FakeServer()
    yield server
    server.close()


@pytest.mark.parametrize("backend", ["vllm", "openai-chat"])
def test_a_server_without_metrics_gets_no_server_figures(fake_server: FakeServer, backend: str,
                                                        tmp_path: Path, capsys) -> None:
    argv = ["--backend", backend, "--host", "127.0.0.1", "--port", str(fake_server.port),
            "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "3", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    assert bench.main(argv) == 0
    out, err = capsys.readouterr()
    assert "Successful requests:                     3" in out
    assert "GPU idle fraction" not in out and "Server steps" not in out
    assert "requests done" not in err and "\r" not in out + err
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["total_output_tokens"], result["backend"]) == (3, 9, backend)
    assert not {"gpu_idle_fraction", "engine_steps", "mean_step_time_ms"} & set(result)
    sent = fake_server.bodies[-1]
    assert sent["model"] == "fake" and sent["stream"] and sent["ignore_eos"] is True
    if backend == "openai-chat":
        assert sent["max_completion_tokens"] == 3
        (message,) = sent["messages"]
        assert message["role"] == "user" and message["content"][0]["type"] == "text"
        assert len(message["content"][0]["text"].split()) == 4  # the random ids, written out by /detokenize
    else:
        assert sent["max_tokens"] == 3 and len(sent["prompt"]) == 4


def test_a_server_reading_the_sample_text_as_one_id_is_refused(capsys) -> None:
    """A word-level tokenizer reads English as its unknown token: prompts drawn from that one id
    would all be equal and the server's prefix cache would serve them, so no run starts."""
    server = FakeServer(tokens=(0, 0, 0))
    try:
        argv = ["--backend", "vllm", "--host", "127.0.0.1", "--port", str(server.port), "--num-prompts", "3",
                "--random-input-len", "4", "--random-output-len", "3", "--disable-tqdm"]
        assert bench.main(argv) != 0
    finally:
        server.close()
    out, err = capsys.readouterr()
    assert "1 distinct id(s)" in out + err and "--tokenizer" in out + err
    assert "Traceback" not in out + err and not server.bodies


# ---------------------------------------------------------------- progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_terminal_and_writes_lines_elsewhere() -> None:
    tty, log = Tty(), io.StringIO()
    for stream, live in ((tty, True), (log, False)):
        bar = Progress(20, "bench", stream, live)
        for _ in range(20):
            bar.advance()
        bar.close()
    assert "\r" in tty.getvalue() and tty.getvalue().endswith("20/20\n")
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines == [f"bench: {n}/20 requests done" for n in range(0, 21, 2)]  # a line per tenth


def test_progress_is_live_only_where_stdout_and_stderr_are_terminals(monkeypatch) -> None:
    monkeypatch.setattr(sys, "stderr", Tty())
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # `vt bench > result.txt`
    assert not Progress.for_run(5, "bench", True).live
    monkeypatch.setattr(sys, "stdout", Tty())
    assert Progress.for_run(5, "bench", True).live
    assert Progress.for_run(5, "bench", False).stream is None  # --disable-tqdm


# ---------------------------------------------------------------- --plot without matplotlib


def test_plot_without_matplotlib_names_installs_that_work(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bench.main(["--port", "9", "--plot", "out.png"]) == 2
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and "pip install -e '.[bench]'" in err
    assert "pip install 'vt-serve[bench]'" not in err and "not on the package index" in err
