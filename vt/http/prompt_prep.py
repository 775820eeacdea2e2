"""Prompt preparation that grows with the request, kept off the event loop and bounded.

- Text too long to fit is refused before it is tokenized: no token of the vocabulary spells
  more than `max_token_chars` characters, so a text of N characters needs at least
  N / max_token_chars tokens (normalizers that shrink text are measured after normalizing).
- Long texts are tokenized in a worker thread through `encode_batch`, which lets go of the GIL
  (`encode` holds it, which would stall the loop as surely as running it there).
- Chat templates render in a worker thread under a trace function that stops them after
  `TEMPLATE_TIMEOUT_S` or once the process has grown by `TEMPLATE_MAX_GROWTH` bytes, and their
  output is held to the same character bound as a prompt.

Each failure is a ProtocolError naming the field: a 400, never a stalled loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from vt.http.engine_client import PromptTokenizer
from vt.http.protocol import ProtocolError

INLINE_CHARS = 4096            # shorter texts tokenize on the loop: a thread hop costs more
TEMPLATE_TIMEOUT_S = 2.0
TEMPLATE_MAX_GROWTH = 512 << 20
# Memory is read at most this often (the clock at every event). Each read lets go of the GIL for
# a moment and takes it straight back, which resets the wait of a thread asking for it: read
# every 5 ms, a looping template kept the event loop to ~10 turns a second; every 20 ms it turns
# as with no reads (~95 turns of 5 ms a second).
_RSS_EVERY_S = 0.02
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
T = TypeVar("T")


class TemplateLimitError(ValueError):
    """A chat template ran too long or grew the process too much."""


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0  # no /proc: only the clock bounds the template


def run_bounded(work: Callable[[], T], timeout_s: float, max_growth: int) -> T:
    """Run work in this thread, raising TemplateLimitError from inside it once it has run for
    timeout_s or the process has grown by max_growth bytes. Python code only: a single long
    C call is checked when it returns."""
    start = time.monotonic()
    deadline = start + timeout_s
    limit = _rss_bytes() + max_growth
    next_rss = start + _RSS_EVERY_S

    def tracer(frame: FrameType, event: str, arg: object) -> Callable[..., object]:
        nonlocal next_rss
        now = time.monotonic()
        if now > deadline:
            raise TemplateLimitError(f"it ran for more than {timeout_s:g} s")
        if now > next_rss:
            next_rss = now + _RSS_EVERY_S
            rss = _rss_bytes()
            if rss and rss > limit:
                raise TemplateLimitError(f"it used more than {max_growth >> 20} MiB")
        return tracer

    sys.settrace(tracer)
    try:
        return work()
    finally:
        sys.settrace(None)


def max_token_chars(tokenizer: PromptTokenizer) -> int | None:
    """The longest token string of the vocabulary (added tokens included), or None if unknown."""
    raw = getattr(tokenizer, "raw", None)
    get_vocab = getattr(raw, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=0) or None


class PromptPreparer:
    """Tokenizes prompts and renders chat templates for the routes, bounded and off the loop."""

    def __init__(self, tokenizer: PromptTokenizer, max_model_len: int, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._token_chars = max_token_chars(tokenizer)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="vt-prompt")

    @property
    def max_chars(self) -> int | None:
        """The longest text that could still fit in max_model_len tokens (None: unbounded)."""
        return None if self._token_chars is None else self.max_model_len * self._token_chars

    def _normalized_len(self, text: str) -> int:
        normalizer = getattr(getattr(self.tokenizer, "raw", None), "normalizer", None)
        return len(text) if normalizer is None else len(normalizer.normalize_str(text))

    def _check_fits(self, text: str, param: str) -> None:
        bound = self.max_chars
        if bound is None or len(text) <= bound // 4:
            return  # no normalizer shrinks text fourfold: the common case skips normalizing
        if self._normalized_len(text) > bound:
            raise ProtocolError(
                f"the prompt has {len(text)} characters, more than any {self.max_model_len}-token "
                f"context can hold (no token spells more than {self._token_chars} characters); "
                f"this model's maximum context length is {self.max_model_len} tokens", param)

    async def _off_loop(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    async def run(self, work: Callable[[], T], size: int) -> T:
        """work() on the loop when `size` (characters, tokens) is small, else in a worker thread."""
        return work() if size <= INLINE_CHARS else await self._off_loop(work)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; text that cannot fit is refused untokenized."""
        def work() -> list[int]:
            if len(text) > INLINE_CHARS:
                self._check_fits(text, param)
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

        return await self.run(work, len(text))

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          template_param: str = "messages", **template: Any) -> str | list[int]:
        """The chat template's text (or token ids) for messages, bounded in time, memory and
        length; `template` holds the tokenizer's other rendering controls (tools, chat_template,
        variables, ...). A template that fails is a 400 naming template_param: `chat_template`
        where the request brought its own, else `messages`."""
        tokenizer = self.tokenizer

        def work() -> str | list[int]:
            try:
                rendered = run_bounded(
                    lambda: tokenizer.apply_chat_template(
                        messages, add_generation_prompt=add_generation_prompt, **template),
                    TEMPLATE_TIMEOUT_S, TEMPLATE_MAX_GROWTH)
            except RecursionError:
                raise ProtocolError("chat template failed: it recursed too deep", "messages") from None
            except MemoryError:
                raise ProtocolError("chat template failed: out of memory", "messages") from None
            except ProtocolError:
                raise
            except ValueError as e:  # ChatTemplateError (which wraps TemplateLimitError)
                text = str(e)
                text = text if text.startswith("chat template") else f"chat template failed: {text}"
                raise ProtocolError(text, template_param) from None
            if isinstance(rendered, str):
                self._check_fits(rendered, "messages")
            return rendered

        return await self._off_loop(work)
