"""`vt serve` of a Qwen3-Embedding-style checkpoint, driven by the official openai client.

The checkpoint (written here with transformers: Qwen3Model weights, a tokenizer that appends
<|endoftext|>, sentence-transformers files naming last-token pooling and a Normalize module) is
served with `--task embed` as a vLLM user starts it, and again with no flag at all (the pooling
runner chosen from its files). Each vector equals transformers' pooled output for the same
token ids within float32 rounding.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from tests.e2e.conftest import start_server
from tests.unit.embedding_models import hf_embeddings, write_embedding_checkpoint

ATOL = 2e-6
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello", "café au lait, s'il vous plaît " * 6]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-models")
    return {
        "matryoshka": write_embedding_checkpoint(root / "qwen3-embedding", tiny_model_dir, eos=True,
                                                 config_extra={"is_matryoshka": True}),
        # a Qwen3ForCausalLM checkpoint without its lm_head, found to be an embedding model by its files
        "plain": write_embedding_checkpoint(root / "qwen3-embedding-plain", tiny_model_dir, layout="causal",
                                            eos=True, seed=1),
    }


@pytest.fixture(scope="module")
def embed_server(checkpoints: dict[str, Path]):
    handle = start_server(checkpoints["matryoshka"], "--task", "embed", "--max-num-batched-tokens", "32",
                          "--max-model-len", "256")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(embed_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="x", max_retries=0, timeout=60)


def token_ids(path: Path, text: str) -> list[int]:
    """The checkpoint's own tokenization (EOS appended), independent of vt."""
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids


def assert_vectors(got: list, want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float32), w, rtol=0, atol=ATOL)


def test_a_string_and_a_batch(client, checkpoints) -> None:
    path = checkpoints["matryoshka"]
    ids = [token_ids(path, t) for t in TEXTS]
    assert all(i[-1] == ids[0][-1] for i in ids)  # the tokenizer appends <|endoftext|>
    one = client.embeddings.create(model=str(path), input=TEXTS[0])  # the client asks for base64
    assert one.object == "list" and one.model == str(path)
    assert one.data[0].index == 0 and one.data[0].object == "embedding"
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])
    batch = client.embeddings.create(model=str(path), input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == sum(map(len, ids))
    want = hf_embeddings(path, ids)
    assert_vectors([one.data[0].embedding], want[:1])
    assert_vectors([d.embedding for d in batch.data], want)  # the long one chunked over steps of 32


def test_token_ids_dimensions_and_base64(client, checkpoints) -> None:
    path = checkpoints["matryoshka"]
    ids = [token_ids(path, t) for t in TEXTS]
    single = client.embeddings.create(model=str(path), input=ids[1], encoding_format="float")
    lists = client.embeddings.create(model=str(path), input=ids, dimensions=16, encoding_format="float")
    raw = client.embeddings.create(model=str(path), input=ids, dimensions=16, encoding_format="base64")
    assert_vectors([single.data[0].embedding], hf_embeddings(path, ids[1:2]))
    want = hf_embeddings(path, ids, dimensions=16)
    assert_vectors([d.embedding for d in lists.data], want)
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    assert_vectors(decoded, want)
    assert all(len(d.embedding) == 16 for d in lists.data)


def test_bad_requests_are_400s_naming_the_field(client, embed_server, checkpoints) -> None:
    path = str(checkpoints["matryoshka"])
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=path, input="word " * 300)  # past --max-model-len 256
    assert e.value.body["param"] == "input" and "maximum context length is 256" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=path, input="hi", dimensions=65)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other-model", input="hi")
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": "hi", "encoding_format": "hex"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    with pytest.raises(openai.NotFoundError) as e:  # no generation on an embedding model's server
        client.completions.create(model=path, prompt="hi", max_tokens=2)
    assert "/v1/embeddings" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=path, messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(f"{embed_server.url}/health").status_code == 200


def test_the_pooling_runner_is_found_from_the_checkpoint_files(checkpoints) -> None:
    path = checkpoints["plain"]
    server = start_server(path)
    try:
        assert "runner: pooling" in server.output() and "from modules.json" in server.output()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        got = client.embeddings.create(model=str(path), input=TEXTS[:2])
        want = hf_embeddings(path, [token_ids(path, t) for t in TEXTS[:2]])
        assert_vectors([d.embedding for d in got.data], want)
        with pytest.raises(openai.BadRequestError) as e:  # its config.json claims no Matryoshka training
            client.embeddings.create(model=str(path), input="hi", dimensions=16)
        assert e.value.body["param"] == "dimensions"
        assert "does not support matryoshka representation" in e.value.body["message"]
    finally:
        assert server.stop() == 0


def test_a_generating_server_has_no_embeddings(vt_server) -> None:
    client = openai.OpenAI(base_url=f"{vt_server.url}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="anything", input="hi")
    assert "--runner pooling" in e.value.body["message"]
