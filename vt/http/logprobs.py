"""Logprobs as the completions and chat APIs shape them, each token named by its text (cached)
or, with return_tokens_as_token_ids, as "token_id:N"."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vt.engine.outputs import TokenLogprob
from vt.http.choices import Choice
from vt.http.engine_client import PromptTokenizer
from vt.http.json_chunks import LazyList

# chat logprobs must be JSON numbers; -inf (a masked token) becomes vLLM's floor value
LOGPROB_FLOOR = -9999.0


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


class Logprobs:
    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)

    def _decode_token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_name(self, as_ids: bool) -> Callable[[int], str]:
        """How logprobs name a token: its text, or "token_id:N" when the client asked for ids
        (return_tokens_as_token_ids: a token whose text is not valid UTF-8 alone stays distinct)."""
        return _token_id_name if as_ids else self._token_text

    def completion(self, logprobs: list[TokenLogprob], choice: Choice, as_ids: bool,
                   lazy: bool = False) -> dict[str, Any]:
        """Completions logprobs; `lazy` leaves the top alternatives (the bulk) to be built as the
        body is written (a LazyList). text_offset counts characters of the generated text either
        way."""
        name = self._token_name(as_ids)
        tokens, token_logprobs, offsets = [], [], []
        for entry in logprobs:
            tokens.append(name(entry.token_id))
            token_logprobs.append(max(entry.logprob, LOGPROB_FLOOR))
            offsets.append(choice.text_offset)
            choice.text_offset += len(self._token_text(entry.token_id))

        def top(i: int) -> dict[str, float]:
            entry = logprobs[i]
            alternatives = {name(token_id): max(logprob, LOGPROB_FLOOR) for token_id, logprob in entry.top}
            # The sampled token is always listed, with its own logprob: keyed by text (as vLLM keys
            # them), another token with the same text may have taken its key.
            alternatives[tokens[i]] = token_logprobs[i]
            return alternatives

        tops = LazyList(len(logprobs), top)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": tops if lazy else tops.materialize(), "text_offset": offsets}

    def chat(self, logprobs: list[TokenLogprob], as_ids: bool, lazy: bool = False) -> dict[str, Any]:
        """Chat logprobs; `lazy` builds each token's entry as the body is written."""
        name = self._token_name(as_ids)

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = name(token_id)
            return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(text.encode())}

        def content(i: int) -> dict[str, Any]:
            sampled = logprobs[i]
            shaped = entry(sampled.token_id, sampled.logprob)
            shaped["top_logprobs"] = [entry(token_id, logprob) for token_id, logprob in sampled.top]
            return shaped

        entries = LazyList(len(logprobs), content)
        return {"content": entries if lazy else entries.materialize()}
