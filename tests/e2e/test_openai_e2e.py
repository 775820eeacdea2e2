"""The real `vt serve` on a tiny random model, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from tests.e2e.conftest import start_server

GREEDY = {"temperature": 0.0}
FIXED_LEN = {"ignore_eos": True}   # random weights may sample EOS at any time; make lengths exact


@pytest.fixture(scope="module")
def model_name(vt_server) -> str:
    return httpx.get(f"{vt_server.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(vt_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vt_server.url}/v1", api_key="x", max_retries=0, timeout=60)


def count_tokens(url: str, **body) -> int:
    r = httpx.post(f"{url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_models_lists_the_served_model(vt_server, tiny_model_dir, client):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_model_dir)]  # the --model argument as given, as vLLM
    # the folder name stays accepted as an alias; the response names the served model
    r = client.completions.create(model=tiny_model_dir.name, prompt="hi", max_tokens=1)
    assert r.model == str(tiny_model_dir)
    raw = httpx.get(f"{vt_server.url}/v1/models").json()["data"][0]
    assert raw["owned_by"] == "vt" and raw["max_model_len"] > 0


def test_completion_usage_matches_tokenize(vt_server, client, model_name):
    prompt = "the quick brown fox"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, **GREEDY,
                                  extra_body=FIXED_LEN)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == count_tokens(vt_server.url, prompt=prompt)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text


def test_greedy_stream_equals_non_stream(client, model_name):
    kw = dict(model=model_name, prompt="once upon a time", max_tokens=8, **GREEDY, extra_body=FIXED_LEN)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_chat_non_stream_and_stream(vt_server, client, model_name):
    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=5, **GREEDY,
                                       extra_body=FIXED_LEN)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == count_tokens(vt_server.url, messages=messages)
    assert r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=5,
                                                 stream=True, **GREEDY, extra_body=FIXED_LEN))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_seeded_choices_are_reproducible(client, model_name):
    kw = dict(model=model_name, prompt="a b c", max_tokens=8, n=2, seed=7, temperature=1.0,
              extra_body=FIXED_LEN)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 16
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = {0: "", 1: ""}
    for c in chunks:
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == {0: a.choices[0].text, 1: a.choices[1].text}


def test_stop_string_truncates_output(client, model_name):
    kw = dict(model=model_name, prompt="hello world", **GREEDY)
    full = client.completions.create(max_tokens=16, extra_body=FIXED_LEN, **kw).choices[0].text
    assert len(full) >= 4, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.completions.create(max_tokens=16, stop=[stop], extra_body=FIXED_LEN, **kw)
    choice = r.choices[0]
    assert choice.text == full[:full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop


def test_completion_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt="one two", max_tokens=4, logprobs=2, **GREEDY,
                                  extra_body=FIXED_LEN)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    for top, chosen, tok in zip(lp.top_logprobs, lp.token_logprobs, lp.tokens):
        assert 1 <= len(top) <= 3 and tok in top
        # greedy: the chosen token is the most likely one
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY,
                                       extra_body=FIXED_LEN)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)


def test_bad_params_give_openai_errors(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[], max_tokens=3)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="x", max_tokens=10**7)
    assert "max_tokens" in e.value.message or "context length" in e.value.message


def test_raw_http_errors_and_framing(vt_server):
    url = vt_server.url
    with httpx.Client(base_url=url, timeout=60) as h:
        assert h.get("/nope").status_code == 404
        r = h.get("/v1/completions")
        assert r.status_code == 405 and "POST" in r.headers["allow"]
        r = h.post("/v1/completions", content=b"{bad", headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = h.post("/v1/completions", content=b"x", headers={"content-type": "text/plain"})
        assert r.status_code == 415
        r = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = r.content.split(b"\n\n")
        assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
        assert all(orjson.loads(f[len(b"data: "):])["object"] == "text_completion" for f in frames[:-2])
        assert h.get("/health").status_code == 200
        assert "version" in h.get("/version").json()
        m = h.get("/metrics")
        assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
        assert "vt:prompt_tokens_total{" in m.text
        assert 'vt:http_responses_total{status="200"}' in m.text
        assert h.post("/detokenize", json={"tokens": h.post("/tokenize", json={
            "prompt": "hello", "add_special_tokens": False}).json()["tokens"]}).json()["prompt"] == "hello"


def test_api_key_and_clean_shutdown(tiny_model_dir):
    server = start_server(tiny_model_dir, "--api-key", "sekrit")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as h:
            assert h.get("/v1/models").status_code == 401
            assert h.get("/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
            assert h.get("/v1/models", headers={"authorization": "Bearer sekrit"}).status_code == 200
            assert h.get("/health").status_code == 200
        ok = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model=tiny_model_dir.name, prompt="hi", max_tokens=2).choices
    finally:
        rc = server.stop()
    assert rc == 0, server.output()
