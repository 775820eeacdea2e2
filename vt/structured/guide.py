"""Guide: one request's place in its grammar, advanced by every token the request generates.

The engine advances a guide with each token as it appends it (in `_process`), before the next
step's mask of that request is computed; a token sampled under the mask is always accepted, so
a rejection means the mask and the matcher disagree and ends the request with an error rather
than letting it go on unconstrained.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vt.structured.spec import matcher_error


class Guide:
    __slots__ = ("matcher", "waiting_for", "shard")

    def __init__(self, matcher: Any, start_after: int | None = None, shard: int = 0) -> None:
        self.matcher = matcher
        self.waiting_for = start_after  # the grammar applies once this token has been generated
        self.shard = shard  # which of the grammar's templates the matcher was copied from

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (False while the request still reasons)."""
        return self.waiting_for is None

    def advance(self, token_id: int) -> str | None:
        """Take a generated token; returns why the grammar rejected it, or None."""
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return None
        if self.matcher.consume_token(token_id) and not self.matcher.is_error():
            return None
        return f"token {token_id} is outside the grammar: {matcher_error(self.matcher)}"

    @property
    def complete(self) -> bool:
        """The output so far is a whole match of the grammar (it may end here, or go on)."""
        return self.waiting_for is None and self.matcher.is_accepting() and not self.matcher.is_error()

    def next_mask(self, words: int) -> np.ndarray:
        """The tokens the grammar allows next, as a bitmask of i32[words] (llguidance's layout:
        bit j of word w allows token 32 w + j); every token while the grammar does not apply yet."""
        mask = np.full((1, words), -1, np.int32)
        if self.active:
            import llguidance.numpy as llg_np

            llg_np.fill_next_token_bitmask(self.matcher, mask, 0)
        return mask[0]

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits no further token: the request stops here. (A
        matcher in error is stopped too, but that is a failure, which advance() reports.)"""
        return self.waiting_for is None and self.matcher.is_stopped() and not self.matcher.is_error()
