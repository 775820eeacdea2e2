"""A vLLM command line and vLLM's request fields against the real `vt serve`, through the official
openai client and raw HTTP: the frontend and engine flags vLLM users pass (a separate tokenizer,
CORS, the response role, generation-config overrides, log switches, the no-ops), VLLM_API_KEY,
return_token_ids, cache_salt, spaces_between_special_tokens, echo, continuous usage stats,
/tokenize's token strings, the assistant's `thinking`, the request histograms of /metrics and the
start-up time."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import ServerHandle, start_server
from vt.model.make_model import make_model

KEY = "vllm-env-key-4321"
NAME = "tiny"
ORIGIN = "https://app.example"
TIMEOUT = 60
FIXED = {"ignore_eos": True, "temperature": 0}  # random weights may sample EOS at any time
SPECIAL = {1: "<|im_start|>", 2: "<|im_end|>"}
# a template that shows what it reads of each message: role, thinking, content
SHOW = ("{% for m in messages %}{{ m.role }}:{% if m.thinking %}[{{ m.thinking }}]{% endif %}"
        "{{ m.content }}\n{% endfor %}")


@dataclass
class Started:
    handle: ServerHandle
    seconds: float  # from just before the process was started to its "serving on" line

    @property
    def url(self) -> str:
        return self.handle.url


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("dropin") / "tiny")


@pytest.fixture(scope="module")
def spaced_tokenizer(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's tokenizer with a decoder that puts a space before every token (WordPiece's)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(model / "tokenizer_config.json", folder)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": False}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def _start(model: Path, *flags: str) -> Started:
    start = time.monotonic()
    handle = start_server(model, "--served-model-name", NAME, *flags)
    return Started(handle, time.monotonic() - start)


@pytest.fixture(scope="module")
def vllm_line(model: Path, spaced_tokenizer: Path) -> Iterator[Started]:
    """A vLLM-style command line, with the API key in vLLM's variable."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_API_KEY", KEY)
        mp.delenv("VT_API_KEY", raising=False)
        started = _start(model, "--tokenizer", str(spaced_tokenizer), "--response-role", "bot",
                         "--enable-log-requests", "--override-generation-config", '{"max_new_tokens": 3}',
                         "--swap-space", "4", "-pp", "1", "-dp", "1", "--disable-frontend-multiprocessing",
                         "--load-format", "safetensors", "--max-seq-len-to-capture", "8192",
                         "--uvicorn-log-level", "info", "--allowed-origins", f'["{ORIGIN}"]',
                         "--trust-request-chat-template")
    yield started
    assert started.handle.stop() == 0


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[Started]:
    started = _start(model, "--disable-uvicorn-access-log", "--return-tokens-as-token-ids")
    yield started
    assert started.handle.stop() == 0


def client(server: Started, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def post(server: Started, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=TIMEOUT)


def wait_for_output(server: Started, pattern: str, timeout: float = 10.0) -> str:
    """The server's output once it matches `pattern` (it is read by a thread)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = server.handle.output()
        if re.search(pattern, text):
            return text
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in the output:\n{server.handle.output()}")


def metric(server: Started, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


# --- the launch line -------------------------------------------------------------------------------

def test_vllm_api_key_guards_the_api_and_the_log_never_shows_it(vllm_line):
    assert httpx.get(f"{vllm_line.url}/v1/models", timeout=TIMEOUT).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(vllm_line, "wrong").models.list()
    assert client(vllm_line, KEY).models.list().data
    log = vllm_line.handle.output()
    assert "API key required" in log and "(from VLLM_API_KEY)" in log and KEY not in log


def test_start_up_time_counts_from_the_process_start(vllm_line):
    seconds = float(re.search(r"start-up took ([\d.]+) s", vllm_line.handle.output()).group(1))
    # the interpreter, the imports and the engine, as whoever waits for the server sees them
    assert 0.5 * vllm_line.seconds <= seconds <= vllm_line.seconds + 0.5


def test_vllm_only_flags_are_noted_once_each(vllm_line):
    log = vllm_line.handle.output()
    for note in ("--swap-space: accepted", "--max-seq-len-to-capture: accepted",
                 "--pipeline-parallel-size 1: accepted", "--data-parallel-size 1: accepted",
                 "--disable-frontend-multiprocessing: accepted", "--load-format safetensors: accepted"):
        assert log.count(note) == 1, note
    assert "from --override-generation-config: max_tokens=3" in log


def test_cors_preflight_and_response_headers(vllm_line):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{vllm_line.url}/v1/chat/completions", headers=preflight, timeout=TIMEOUT)
    assert (r.status_code, r.text) == (200, "OK")  # no API key asked of a preflight
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.options(f"{vllm_line.url}/v1/chat/completions", timeout=TIMEOUT,
                      headers={**preflight, "Origin": "https://elsewhere.example"})
    assert (r.status_code, r.text) == (400, "Disallowed CORS origin")
    r = httpx.get(f"{vllm_line.url}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"},
                  timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_the_tokenizer_folder_is_the_one_served(vllm_line, plain):
    ids = {"tokens": [1, 2]}
    assert post(vllm_line, "/detokenize", ids, KEY).json()["prompt"] == "<|im_start|> <|im_end|>"
    assert post(plain, "/detokenize", ids).json()["prompt"] == "<|im_start|><|im_end|>"


def test_override_generation_config_caps_max_tokens_as_max_new_tokens(vllm_line):
    chat = client(vllm_line, KEY).chat.completions
    for extra in ({}, {"max_tokens": 10}):
        r = chat.create(model=NAME, messages=[{"role": "user", "content": "hi"}], extra_body=FIXED, **extra)
        assert r.usage.completion_tokens == 3


def test_response_role_names_the_reply(vllm_line):
    body = {"messages": [{"role": "user", "content": "hi"}], **FIXED}
    assert post(vllm_line, "/v1/chat/completions", body, KEY).json()["choices"][0]["message"]["role"] == "bot"
    r = post(vllm_line, "/v1/chat/completions", {**body, "stream": True}, KEY)
    first = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "bot"


def test_access_and_request_log_lines(vllm_line, plain):
    client(vllm_line, KEY).completions.create(model=NAME, prompt="hello", max_tokens=2)
    log = wait_for_output(vllm_line, r'"POST /v1/completions HTTP/1\.1" 200 OK')
    assert re.search(r'INFO vt\.access: 127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200 OK', log)
    assert re.search(r"INFO vt\.http: request cmpl-\w+: prompt tokens", log)
    client(plain).completions.create(model=NAME, prompt="hello", max_tokens=2)
    assert "vt.access" not in plain.handle.output()  # --disable-uvicorn-access-log


# --- request fields -----------------------------------------------------------------------------------

def test_spaces_between_special_tokens(vllm_line):
    # only the two special tokens may be sampled; the served tokenizer's decoder spaces every token
    body = {"prompt": "hello", "allowed_token_ids": [1, 2], "skip_special_tokens": False,
            "return_token_ids": True, **FIXED}
    texts = {}
    for spaced in (True, False):
        choice = post(vllm_line, "/v1/completions", {**body, "spaces_between_special_tokens": spaced},
                      KEY).json()["choices"][0]
        tokens = [SPECIAL[t] for t in choice["token_ids"]]
        texts[spaced] = (choice["text"], tokens)
    assert texts[True][0].strip() == " ".join(texts[True][1])
    assert texts[False][0].strip() == "".join(texts[False][1])
    assert len(texts[False][1]) == 3


def test_thinking_and_text_parts_reach_the_template(vllm_line):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c", "thinking": "hmm"}]
    rendered = post(vllm_line, "/tokenize", {"messages": messages, "chat_template": SHOW}, KEY)
    assert rendered.status_code == 200, rendered.text
    expected = post(vllm_line, "/tokenize", {"prompt": "user:a\nb\nassistant:[hmm]c\n",
                                             "add_special_tokens": False}, KEY).json()["tokens"]
    assert rendered.json()["tokens"] == expected


def test_tokenize_returns_the_vocabulary_entries(plain, model):
    hf = AutoTokenizer.from_pretrained(str(model))
    body = post(plain, "/tokenize", {"prompt": "Hello there, world", "return_token_strs": True}).json()
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])


def test_return_token_ids_whole_and_streamed(plain):
    messages = [{"role": "user", "content": "tell me"}]
    prompt = post(plain, "/tokenize", {"messages": messages}).json()["tokens"]
    chat = client(plain).chat.completions
    with_ids = {**FIXED, "return_token_ids": True}
    r = chat.create(model=NAME, messages=messages, max_tokens=5, extra_body=with_ids)
    assert r.prompt_token_ids == prompt
    ids = r.choices[0].token_ids
    assert len(ids) == r.usage.completion_tokens == 5
    assert post(plain, "/detokenize", {"tokens": ids}).json()["prompt"] == r.choices[0].message.content
    chunks = list(chat.create(model=NAME, messages=messages, max_tokens=5, stream=True,
                              extra_body={**FIXED, "return_token_ids": True}))
    assert chunks[0].prompt_token_ids == prompt
    assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == ids
    done = client(plain).completions.create(model=NAME, prompt="tell me", max_tokens=4,
                                            extra_body={**FIXED, "return_token_ids": True})
    prompt = post(plain, "/tokenize", {"prompt": "tell me"}).json()["tokens"]
    assert done.choices[0].prompt_token_ids == prompt
    assert len(done.choices[0].token_ids) == 4


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(plain):
    prompt = " ".join(f"word{i}" for i in range(40))  # several full blocks
    hits = []
    for salt in ("tenant-a", "tenant-a", "tenant-b", None, None):
        before = metric(plain, "vllm:prefix_cache_hits_total")
        extra = {**FIXED, **({"cache_salt": salt} if salt else {})}
        client(plain).completions.create(model=NAME, prompt=prompt, max_tokens=1, extra_body=extra)
        hits.append(metric(plain, "vllm:prefix_cache_hits_total") - before)
    assert hits[0] == hits[2] == hits[3] == 0
    assert hits[1] == hits[4] >= 32


def test_completions_echo(plain):
    completions = client(plain).completions
    r = completions.create(model=NAME, prompt="Once upon", max_tokens=3, echo=True, extra_body=FIXED)
    assert r.choices[0].text.startswith("Once upon") and len(r.choices[0].text) > len("Once upon")
    streamed = "".join(c.choices[0].text for c in completions.create(
        model=NAME, prompt="Once upon", max_tokens=3, echo=True, stream=True, extra_body=FIXED))
    assert streamed == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        completions.create(model=NAME, prompt="Once upon", max_tokens=3, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo" and "logprobs" in e.value.body["message"]


def test_continuous_usage_stats(plain):
    chunks = list(client(plain).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body=FIXED))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == [0, 1, 2, 3, 4, 4]  # the role chunk, one per token, the final usage
    assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_repetition_penalty_above_two_is_served(plain):
    r = client(plain).completions.create(model=NAME, prompt="hi", max_tokens=3,
                                         extra_body={**FIXED, "repetition_penalty": 3})
    assert r.usage.completion_tokens == 3


def test_return_tokens_as_token_ids_is_the_servers_default(plain):
    chat = client(plain).chat.completions
    messages = [{"role": "user", "content": "hi"}]
    r = chat.create(model=NAME, messages=messages, max_tokens=2, logprobs=True, extra_body=FIXED)
    assert all(re.fullmatch(r"token_id:\d+", t.token) for t in r.choices[0].logprobs.content)
    r = chat.create(model=NAME, messages=messages, max_tokens=2, logprobs=True,
                    extra_body={**FIXED, "return_tokens_as_token_ids": False})
    assert not any(t.token.startswith("token_id:") for t in r.choices[0].logprobs.content)


def test_metrics_carry_the_request_histograms_vllms_dashboard_reads(plain):
    client(plain).completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body=FIXED)
    text = httpx.get(f"{plain.url}/metrics", timeout=TIMEOUT).text
    for family in ("request_queue_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                   "iteration_tokens_total"):
        assert f"# TYPE vllm:{family} histogram" in text, family
        assert metric(plain, f"vllm:{family}_count") >= 1, family
    assert 'vllm:request_queue_time_seconds_bucket{model_name="' in text and 'le="7680.0"' in text
    assert re.search(r'vllm:iteration_tokens_total_bucket\{[^}]*le="16384\.0"\}', text)


@pytest.mark.parametrize("field, value", [("logits_processors", ["my_module.MyProcessor"]),
                                          ("vllm_xargs", {"threshold": 1})])
def test_fields_vt_cannot_honour_are_a_400_naming_them(plain, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client(plain).completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]
