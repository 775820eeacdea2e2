"""The tokenizer the grammar engine reads: added tokens that are text become vocabulary entries."""

from __future__ import annotations

import orjson
import pytest

from vt.structured.grammar_vocab import grammar_tokenizer_json, vocab_piece
from vt.structured.guide import Guide


def _tokenizer(decoder: dict, added: list[dict]) -> str:
    vocab = {"a": 0, "b": 1, "<": 2, "Ċ": 3}
    return orjson.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "decoder": decoder,
                         "added_tokens": added}).decode()


def _added(tid: int, content: str, special: bool) -> dict:
    return {"id": tid, "content": content, "special": special, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False}


BYTE_LEVEL = {"type": "ByteLevel"}
SENTENCEPIECE = {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]}


@pytest.mark.parametrize("decoder, content, piece", [
    (BYTE_LEVEL, "<think>", "<think>"),
    (BYTE_LEVEL, "<tool call>\n", "<toolĠcall>Ċ"),      # space and newline in the byte alphabet
    (BYTE_LEVEL, "é", "Ã©"),                              # UTF-8 bytes, each its own character
    (SENTENCEPIECE, "<a b>", "<a\u2581b>"),
])
def test_text_tokens_move_into_the_vocabulary_under_their_ids(decoder, content, piece):
    text = _tokenizer(decoder, [_added(10, "<|im_end|>", True), _added(11, content, False)])
    out = orjson.loads(grammar_tokenizer_json(text))
    assert [t["content"] for t in out["added_tokens"]] == ["<|im_end|>"]  # special ones stay special
    assert out["model"]["vocab"][piece] == 11
    assert vocab_piece(content, decoder is BYTE_LEVEL) == piece


def test_tokenizers_without_text_tokens_are_left_as_they_are():
    only_special = _tokenizer(BYTE_LEVEL, [_added(10, "<|im_end|>", True)])
    assert grammar_tokenizer_json(only_special) == only_special
    # a spelling that already names another token: that added token stays where it is
    clash = _tokenizer(BYTE_LEVEL, [_added(12, "<", False)])
    assert grammar_tokenizer_json(clash) == clash


class _Matcher:
    def consume_token(self, token_id: int) -> bool:
        return False

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return ("Parser Error: token doesn't satisfy the grammar\n<state>\nTokens: ...\n</state>"
                "<grammar>x</grammar>")


def test_a_rejected_token_reports_the_reason_without_the_parser_dump():
    why = Guide(_Matcher()).advance(5)
    assert why == "token 5 is outside the grammar: Parser Error: token doesn't satisfy the grammar"
