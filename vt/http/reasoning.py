"""`--reasoning-parser qwen3`: the model's <think>...</think> becomes `reasoning_content`.

As vLLM's qwen3 parser: a `<think>` the model writes is dropped, the text up to `</think>` is
reasoning and what follows is content; output with no `</think>` is all reasoning (it was cut
short), unless the prompt already closed the thinking (`enable_thinking: false` makes Qwen3's
template end the prompt with `<think>\\n\\n</think>\\n\\n`): then it is all content.

The prompt counts as closed when the last think tag of its final turn is `</think>`: the scan
from the end stops at the turn's `<|im_start|>`, so a `</think>` of an earlier assistant turn
(kept by Qwen3's template during a tool-calling exchange) does not count.

The same `</think>` token id gates structured outputs: the grammar applies to the content, from
the token after it (vt.structured.spec.StructuredOutput.start_after).
"""

from __future__ import annotations

from vt.http.engine_client import PromptTokenizer

PARSERS = ("qwen3",)
THINK_START, THINK_END = "<think>", "</think>"
TURN_START = "<|im_start|>"


class ReasoningParser:
    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.start_id = tokenizer.token_to_id(THINK_START)
        self.end_id = tokenizer.token_to_id(THINK_END)
        if self.start_id is None or self.end_id is None:
            raise ValueError(f"--reasoning-parser qwen3 needs the tokens {THINK_START} and {THINK_END} in "
                             f"the model's tokenizer, which lacks them")
        self.turn_id = tokenizer.token_to_id(TURN_START)

    def prompt_closed(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends its thinking itself (the output is then all content)."""
        for t in reversed(prompt_ids):
            if t == self.end_id:
                return True
            if t == self.start_id or t == self.turn_id:
                return False
        return False

    def stream(self, prompt_closed: bool) -> ReasoningStream:
        return ReasoningStream(not prompt_closed)


def _holdback(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of text that could begin one of tags."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if tag.startswith(text[-n:]):
                best = n
                break
    return best


class ReasoningStream:
    """Output text in -> (reasoning delta, content delta) out, for one choice."""

    def __init__(self, reasoning: bool) -> None:
        self.reasoning = reasoning        # still inside the thinking
        self.had_reasoning = reasoning
        self._start_dropped = False
        self._pending = ""

    def push(self, text: str) -> tuple[str, str]:
        if not self.reasoning:
            return "", text
        text = self._pending + text
        self._pending = ""
        if not self._start_dropped and (i := text.find(THINK_START)) >= 0 and \
                (THINK_END not in text or i < text.find(THINK_END)):
            text = text[:i] + text[i + len(THINK_START):]
            self._start_dropped = True
        end = text.find(THINK_END)
        if end >= 0:
            self.reasoning = False
            return text[:end], text[end + len(THINK_END):]
        keep = _holdback(text, (THINK_END,) if self._start_dropped else (THINK_END, THINK_START))
        self._pending = text[len(text) - keep:]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        held, self._pending = self._pending, ""
        return (held, "") if self.reasoning else ("", held)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning_content, content), None where there is none."""
        r1, c1 = self.push(text)
        r2, c2 = self.finish()
        content = c1 + c2
        return (r1 + r2) if self.had_reasoning else None, content or None
