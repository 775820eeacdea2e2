"""A vLLM user's habits against the real `vt serve`, through the official openai client: the chat
template controls (prompts compared with transformers' apply_chat_template), several prompts in
one completions request, the checkpoint's sampling defaults, and a vLLM-style launch line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import start_server
from vt.model.make_model import make_model

TEMPLATE_FILE = Path(__file__).resolve().parents[1] / "templates" / "qwen3_like.jinja"
# what the checkpoint's generation_config.json recommends: top_k 1 makes any temperature greedy
RECOMMENDED = {"temperature": 0.7, "top_k": 1, "max_new_tokens": 24}
FIXED = {"ignore_eos": True}   # random weights may sample EOS at any time; make lengths exact
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CONTINUE = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
OTHER_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_model(tmp_path_factory.mktemp("habits") / "qwen3-like")
    (path / "chat_template.jinja").write_text(TEMPLATE_FILE.read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, **RECOMMENDED}))
    return path


@pytest.fixture(scope="module")
def server(chat_model: Path):
    handle = start_server(chat_model, "--trust-request-chat-template")
    yield handle
    handle.stop()


def make_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return make_client(server.url)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def hf_tok(chat_model: Path):
    return AutoTokenizer.from_pretrained(str(chat_model))


def hf_count(tok, messages: list[dict], **controls) -> int:
    controls = {"add_generation_prompt": True, **controls}
    return len(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **controls))


def tokenize(url: str, **body) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def chat_prompt_tokens(client: openai.OpenAI, model: str, messages: list[dict], body: dict) -> int:
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                       extra_body=body)
    return r.usage.prompt_tokens


# --- chat template controls ---------------------------------------------------------------------

CONTROLS = {
    "thinking off": (USER, {"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    "no generation prompt": (USER, {"add_generation_prompt": False}, {"add_generation_prompt": False}),
    "continue the final message": (CONTINUE, {"add_generation_prompt": False, "continue_final_message": True},
                                   {"add_generation_prompt": False, "continue_final_message": True}),
    "tools": (USER, {"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS}),
    "request template": (USER, {"chat_template": OTHER_TEMPLATE}, {"chat_template": OTHER_TEMPLATE}),
}


@pytest.mark.parametrize("case", CONTROLS)
def test_chat_template_controls_shape_the_prompt_as_transformers_does(server, client, model, hf_tok, case):
    messages, body, hf_controls = CONTROLS[case]
    used = chat_prompt_tokens(client, model, messages, body)
    prompt = tokenize(server.url, model=model, messages=messages, **body)
    assert used == len(prompt) == hf_count(hf_tok, messages, **hf_controls)
    assert prompt == hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                **{"add_generation_prompt": True, **hf_controls})
    plain = {"continue the final message": {"add_generation_prompt": False}}.get(case, {})
    assert prompt != tokenize(server.url, model=model, messages=messages, **plain)  # the control counts


def test_continue_final_message_with_echo_returns_the_whole_message(client, model):
    body = {"add_generation_prompt": False, "continue_final_message": True, "echo": True, **FIXED}
    r = client.chat.completions.create(model=model, messages=CONTINUE, max_tokens=5, temperature=0,
                                       extra_body=body)
    message = r.choices[0].message
    assert message.role == "assistant" and message.content.startswith("Once upon a")
    assert len(message.content) > len("Once upon a") and r.usage.completion_tokens == 5
    chunks = client.chat.completions.create(model=model, messages=CONTINUE, max_tokens=5, temperature=0,
                                            extra_body=body, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content


def test_developer_role_is_system(client, model):
    def prompt_tokens(role: str) -> int:
        return chat_prompt_tokens(client, model, [{"role": role, "content": "Be brief."}, *USER], {})

    assert prompt_tokens("developer") == prompt_tokens("system") > chat_prompt_tokens(client, model, USER, {})


# --- several prompts in one completions request -------------------------------------------------

PROMPTS = ["the quick brown", "hello world, this is a longer prompt"]


def test_batch_prompts_answer_each_prompt_in_index_order(server, client, model):
    kw = dict(model=model, max_tokens=5, temperature=0, extra_body=FIXED)
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
    want = [alone[0], alone[0], alone[1], alone[1]]
    ids = [tokenize(server.url, model=model, prompt=p) for p in PROMPTS]
    for prompt in (PROMPTS, ids):
        r = client.completions.create(prompt=prompt, n=2, **kw)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == want
        assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 20
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(prompt=PROMPTS, n=2, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want


# --- the checkpoint's sampling defaults -------------------------------------------------------------

def _sampled(client: openai.OpenAI, model: str, extra: dict) -> list[str]:
    return [client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=s,
                                      extra_body={**FIXED, **extra}).choices[0].text for s in (1, 2, 3)]


def test_generation_config_defaults_fill_what_a_request_leaves_unset(client, model):
    greedy = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                       extra_body=FIXED).choices[0].text
    assert _sampled(client, model, {}) == [greedy] * 3            # the file's top_k 1
    assert _sampled(client, model, {"top_k": 0}) != [greedy] * 3  # the request's own top_k wins
    for max_tokens in (None, 100):  # the file's max_new_tokens caps max_tokens
        r = client.chat.completions.create(model=model, messages=USER, max_tokens=max_tokens,
                                           extra_body=FIXED)
        assert r.usage.completion_tokens == RECOMMENDED["max_new_tokens"]
        assert r.choices[0].finish_reason == "length"


def test_detokenize_takes_every_id_the_model_can_sample(server, chat_model, model):
    vocab = json.loads((chat_model / "config.json").read_text())["vocab_size"]
    for token in range(vocab - 30, vocab):
        r = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": [token]})
        assert r.status_code == 200 and r.json()["prompt"], (token, r.text)


# --- a vLLM-style launch line ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, chat_model: Path):
    """`vt serve acme/tiny-chat ...` from the local Hugging Face cache, on a checkpoint without a
    chat template (the launch line brings one), with the flags a vLLM script passes."""
    hub = tmp_path_factory.mktemp("hf") / "hub"
    repo = hub / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(chat_model, snapshot)
    (snapshot / "chat_template.jinja").unlink()
    config = json.loads((snapshot / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(hub))
        handle = start_server(
            None, "acme/tiny-chat", "--dtype", "auto", "--trust-remote-code", "--tensor-parallel-size", "1",
            "--seed", "0", "--max-model-len", "1024", "--gpu-memory-utilization", "0.9",
            "--max-num-seqs", "16", "--enable-prefix-caching", "--disable-log-stats",
            "--disable-log-requests", "--max-logprobs", "5", "--generation-config", "vllm",
            "--chat-template", str(TEMPLATE_FILE))
    yield handle
    handle.stop()


def test_a_vllm_launch_line_serves(launched, hf_tok):
    client = make_client(launched.url)
    assert [m.id for m in client.models.list().data] == ["acme/tiny-chat"]
    # chat works from --chat-template, rendering what transformers renders with that template
    for name in ("acme/tiny-chat", "tiny-chat"):
        assert chat_prompt_tokens(client, name, USER, {}) == hf_count(hf_tok, USER)
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.chat.completions.create(model="acme/tiny-chat", messages=USER, max_tokens=2, logprobs=True,
                                       top_logprobs=6)
    # --generation-config vllm: the checkpoint's top_k 1 does not apply, so sampling samples
    greedy = client.completions.create(model="acme/tiny-chat", prompt=PROMPTS[0], max_tokens=16,
                                       temperature=0, extra_body=FIXED).choices[0].text
    assert _sampled(client, "acme/tiny-chat", {}) != [greedy] * 3
    log = launched.output()
    assert "--trust-remote-code: accepted" in log
    assert "KV cache: " in log and "maximum concurrency at 1024 tokens per request" in log
    assert "start-up took" in log and "default sampling parameters" not in log
