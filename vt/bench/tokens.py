"""Tokens on the benchmark's side: the ids random prompts are drawn from, and text <-> ids for
ShareGPT counts and chat messages, from a local tokenizer.json or else the server's /tokenize and
/detokenize (vLLM's routes, which vt serves too). Nothing is downloaded."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from vt.bench.client import BenchError, Endpoint, error_text, http_json

POOL_TEXT = (
    "The quick brown fox jumps over the lazy dog. A serving benchmark sends many prompts at once, "
    "streams every token back and measures how long each one took. Numbers, like 42 and 3.14, "
    "punctuation; names such as Paris, Tokyo and Lagos; and plain words fill the vocabulary pool."
)
SERVER_CALLS_IN_FLIGHT = 16  # /tokenize calls at once while counting a dataset on the server


def tokenizer_folder(name: str) -> Path:
    """The folder holding `name`'s tokenizer.json: `name` itself, a checkpoint folder, or a
    Hugging Face id in the local cache. Raises FileNotFoundError saying what was looked for."""
    path = Path(name).expanduser()
    if path.is_dir() or name.startswith((".", "/", "~")):  # a path, not a Hugging Face id
        if (path / "tokenizer.json").is_file():
            return path
        raise FileNotFoundError(f"no tokenizer.json in {name}" if path.is_dir() else f"no folder {name}")
    from vt.model.locate import resolve_model

    folder = resolve_model(name)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    return folder


def pool_from_tokenizer(model_dir: str) -> list[int]:
    """Every non-special id of the checkpoint's tokenizer."""
    from vt.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_folder(model_dir))
    special = set(tok.special_ids) | set(tok.eos_token_ids)
    return [i for i in range(tok.vocab_size) if i not in special]


async def pool_from_server(ep: Endpoint, model: str) -> list[int]:
    """Distinct ids of a fixed English text as the server's tokenizer encodes it."""
    status, body = await http_json(ep, "POST", "/tokenize",
                                   {"model": model, "prompt": POOL_TEXT, "add_special_tokens": False})
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("tokens"), list):
        raise BenchError(f"POST /tokenize failed: {error_text(status, body)}")
    pool = sorted(set(body["tokens"]))
    if len(pool) < 2:
        # One id (a word-level vocabulary maps English to its unknown token) would make every random
        # prompt the same run of it: the server's prefix cache would answer them all, not its model.
        raise BenchError(f"the server's tokenizer reads vt bench's sample text as {len(pool)} distinct "
                         "id(s), so every random prompt would be the same; pass --tokenizer with the "
                         "checkpoint's folder to draw prompts from its whole vocabulary")
    return pool


class TextTokens(Protocol):
    """Text to ids (with special tokens, as a tokenizer call counts them) and ids to text."""

    async def encode(self, texts: Sequence[str]) -> list[list[int]]: ...

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]: ...


class LocalTokens:
    """A checkpoint's tokenizer.json, read here."""

    def __init__(self, model_dir: str) -> None:
        from vt.text.tokenizer import Tokenizer

        self.tok = Tokenizer.from_dir(tokenizer_folder(model_dir))

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tok.encode(t, add_special_tokens=True) for t in texts]

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return [self.tok.decode(list(i), skip_special_tokens=False) for i in ids]


class ServerTokens:
    """The server's POST /tokenize and /detokenize, where no tokenizer is found on this side."""

    def __init__(self, ep: Endpoint, model: str) -> None:
        self.ep, self.model = ep, model
        self._slots = asyncio.Semaphore(SERVER_CALLS_IN_FLIGHT)

    async def _call(self, path: str, body: dict, key: str) -> object:
        async with self._slots:
            try:
                status, reply = await http_json(self.ep, "POST", path, body)
            except OSError as e:
                raise BenchError(f"POST {path} failed: {e}") from None
        if status != 200 or not isinstance(reply, dict) or key not in reply:
            raise BenchError(f"POST {path} failed (no local tokenizer: give --tokenizer or a --model found "
                             f"here): {error_text(status, reply)}")
        return reply[key]

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        calls = [self._call("/tokenize", {"model": self.model, "prompt": t, "add_special_tokens": True},
                            "tokens") for t in texts]
        return list(await asyncio.gather(*calls))  # type: ignore[arg-type]

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        calls = [self._call("/detokenize", {"model": self.model, "tokens": list(i)}, "prompt") for i in ids]
        return list(await asyncio.gather(*calls))  # type: ignore[arg-type]
