"""`vt bench` takes `vllm bench serve`'s command lines: vLLM's flag names with vLLM's meanings, vt's
own names kept as aliases, and a clear refusal (exit 2, no traceback) of what vt does not do."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest

from vt.bench import run as bench
from vt.bench.options import build_bench_parser, config_from_args


def parse(line: str):
    return config_from_args(build_bench_parser().parse_args(shlex.split(line)))


def test_a_vllm_command_line_against_a_running_server() -> None:
    cfg = parse("--backend vllm --host 10.0.0.5 --port 8001 --model Org/Some-Model --served-model-name m "
                "--dataset-name random --random-input-len 32 --random-output-len 8 --random-range-ratio 0.1 "
                "--random-prefix-len 16 --num-prompts 200 --request-rate 4 --burstiness 0.5 "
                "--max-concurrency 8 --ignore-eos --seed 3 --temperature 0.7 --top-p 0.9 --top-k 20 "
                "--percentile-metrics ttft,tpot --metric-percentiles 50,99.9 --goodput ttft:200 tpot:50 "
                "--save-result --save-detailed --result-dir out --result-filename r.json --label L "
                "--metadata tp=1 gpu=h100 --disable-tqdm --trust-remote-code")
    assert cfg.base_url == "http://10.0.0.5:8001" and cfg.endpoint == "/v1/completions" and not cfg.chat
    assert cfg.model_hint == "Org/Some-Model" and cfg.model_name == "m"
    assert cfg.model_dir is None  # not found here: the server tokenizes
    assert (cfg.input_len, cfg.output_len, cfg.range_ratio, cfg.prefix_len) == (32, 8, 0.1, 16)
    assert (cfg.num_prompts, cfg.request_rate, cfg.burstiness, cfg.max_concurrency) == (200, 4.0, 0.5, 8)
    assert cfg.ignore_eos and cfg.seed == 3
    assert (cfg.temperature, cfg.top_p, cfg.top_k) == (0.7, 0.9, 20)
    assert cfg.percentile_metrics == ("ttft", "tpot") and cfg.metric_percentiles == (50.0, 99.9)
    assert cfg.goodput_slo_ms == {"ttft": 200.0, "tpot": 50.0}
    assert cfg.save_result and cfg.save_detailed
    assert (cfg.result_dir, cfg.result_filename, cfg.label) == ("out", "r.json", "L")
    assert cfg.metadata == {"tp": "1", "gpu": "h100"}
    assert not cfg.progress


def test_vllm_defaults_where_a_flag_is_left_out() -> None:
    cfg = parse("--port 8000")
    assert cfg.base_url == "http://127.0.0.1:8000"      # vLLM's default host
    assert parse("--host ::1").base_url == "http://[::1]:8000"
    assert cfg.backend == "openai" and cfg.dataset_name == "random"
    assert math.isinf(cfg.request_rate) and cfg.burstiness == 1.0
    assert cfg.ignore_eos  # on for random, as vLLM forces it
    assert not cfg.save_result and cfg.progress


def test_chat_backend_posts_to_the_chat_route() -> None:
    assert parse("--port 1 --backend openai-chat").endpoint == "/v1/chat/completions"
    cfg = parse("--port 1 --backend openai-chat --endpoint /v1/chat/completions")
    assert cfg.chat and cfg.endpoint == "/v1/chat/completions"


def test_vt_names_are_aliases_of_vllms() -> None:
    a = parse("--port 1 --input-len 20 --range-ratio 0.2 --model-name x --no-progress")
    b = parse("--port 1 --random-input-len 20 --random-range-ratio 0.2 --served-model-name x --disable-tqdm")
    assert a == b


def test_output_len_sets_every_datasets_output_length(tmp_path: Path) -> None:
    data = tmp_path / "d.json"
    data.write_text("[]")
    assert parse("--port 1 --random-output-len 9").output_len == 9
    assert parse("--port 1").output_len == 128
    assert parse("--port 1 --output-len 5 --random-output-len 9").output_len == 5  # vLLM: --output-len wins
    sg = parse(f"--port 1 --dataset-name sharegpt --dataset-path {data} --output-len 5")
    assert sg.sharegpt_output_len == 5
    sg = parse(f"--port 1 --dataset-name sharegpt --dataset-path {data} --sharegpt-output-len 6")
    assert sg.sharegpt_output_len == 6 and not sg.ignore_eos  # sharegpt stops at EOS unless --ignore-eos
    assert parse(f"--port 1 --dataset-name sharegpt --dataset-path {data}").sharegpt_output_len is None


def test_base_url_path_prefixes_every_route() -> None:
    from vt.bench.client import Endpoint, _request_bytes

    cfg = parse("--base-url http://127.0.0.1:8000/gateway/")
    ep = Endpoint.from_url(cfg.base_url)
    assert (ep.host, ep.port, ep.prefix) == ("127.0.0.1", 8000, "/gateway")
    assert _request_bytes(ep, "GET", "/v1/models", None, False).startswith(b"GET /gateway/v1/models HTTP/1.1")


def test_model_found_here_gives_the_tokenizer_against_a_running_server(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "tokenizer.json").write_text("{}")
    cfg = parse(f"--port 1 --model {ckpt}")
    assert cfg.model_hint == str(ckpt) and cfg.tokenizer_dir == str(ckpt)
    assert parse(f"--port 1 --tokenizer {ckpt}").tokenizer_dir == str(ckpt)


@pytest.mark.parametrize(("args", "message"), [
    ("--dataset-name sonnet", "vLLM's 'sonnet' dataset is not served; vt bench serves random"),
    ("--dataset-name hf", "sharegpt (a ShareGPT JSON file"),
    ("--dataset-name nope", "unknown dataset 'nope'"),
    ("--backend openai-embeddings", "vLLM's 'openai-embeddings' backend is not served"),
    ("--backend tgi", "unknown backend 'tgi'; vt bench serves openai and vllm"),
    ("--dataset-name sharegpt", "--dataset-name sharegpt needs --dataset-path FILE"),
    ("--dataset-name sharegpt --dataset-path /nonexistent.json", "/nonexistent.json: no such file"),
    ("--dataset-path x.json", "the random dataset takes no file"),
    ("--base-url https://example.com:443", "https is not supported"),
    ("--base-url ftp://x:1", "--base-url must look like http://HOST:PORT"),
    ("--port 70000", "--port: must be a port number"),
    ("--burstiness 0", "--burstiness: must be positive"),
    ("--burstiness x", "--burstiness: not a number"),
    ("--top-p 1.5", "--top-p: must be in (0, 1]"),
    ("--top-k -2", "--top-k: must be -1"),
    ("--random-prefix-len -1", "--random-prefix-len: must be 0 or more"),
    ("--random-input-len 1 --random-range-ratio 0.5", "--random-input-len 1 is too small"),
    ("--percentile-metrics ttft,latency", "unknown metric 'latency'"),
    ("--percentile-metrics e2el_including_client_queue", "is not measured by vt bench"),
    ("--metric-percentiles 99,abc", "'abc' is not a number"),
    ("--metric-percentiles 150", "150 is not a percentile in [0, 100]"),
    ("--metadata novalue", "--metadata expects KEY=VALUE"),
    ("--endpoint v1/completions", "--endpoint must be a path starting with '/'"),
    ("--endpoint /v1/chat/completions", "use --backend openai-chat for that"),
    ("--backend openai-chat --endpoint /v1/completions", "must end with chat/completions"),
    ("--compare-async --port 8000", "--compare-async starts its own servers"),
    ("--compare-async --save-result", "with --compare-async use --json FILE"),
    ("--port 1 --tokenizer /nonexistent", "--tokenizer: no folder /nonexistent"),
    ("--ramp-up-strategy linear", "unrecognized arguments: --ramp-up-strategy"),
])
def test_refusals_are_one_clear_message(args: str, message: str, capsys) -> None:
    assert bench.main(shlex.split(args)) == 2
    err = capsys.readouterr().err
    assert message in err and "vt bench" in err and "Traceback" not in err
