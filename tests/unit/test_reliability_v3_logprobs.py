"""Completions logprobs name tokens by their text, as vLLM does, so two tokens with one text share
a key in top_logprobs; the sampled token's entry is always its own logprob, the one
token_logprobs reports."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from vt.engine.outputs import TokenLogprob
from vt.http.choices import Choice
from vt.http.logprobs import Logprobs


class TwinTokenizer:
    """Tokens 5 and 6 both read "x" (as a word and its byte-level twin do in real vocabularies)."""

    vocab_size = 16
    eos_token_ids = (0,)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join("x" if i in (5, 6) else chr(ord("a") + i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") for c in text]


@pytest.mark.parametrize("sampled", [5, 6])
def test_the_sampled_token_keeps_its_own_logprob_when_another_shares_its_text(sampled: int) -> None:
    twin = 11 - sampled
    own, other = (-1.5, -0.25)  # the twin is likelier: listed first among the top
    entry = TokenLogprob(sampled, own, ((twin, other), (sampled, own), (3, -2.0)))
    shaped = Logprobs(TwinTokenizer()).completion([entry], Choice(0, "r"), as_ids=False)
    assert shaped["tokens"] == ["x"] and shaped["token_logprobs"] == [own]
    [top] = shaped["top_logprobs"]
    assert top["x"] == own and top["d"] == -2.0
    # ids stay distinct when the client asks for them
    by_id = Logprobs(TwinTokenizer()).completion([entry], Choice(0, "r"), as_ids=True)["top_logprobs"][0]
    assert by_id == {f"token_id:{twin}": other, f"token_id:{sampled}": own, "token_id:3": -2.0}
