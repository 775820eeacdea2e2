"""The tokenizer as the grammar engine must see it: added tokens that are text stay text.

llguidance reads tokenizer.json and treats every entry of `added_tokens` as a special token (a
marker byte and its id, never text), the ones marked `"special": false` included. Qwen3's
`<think>`, `</think>`, `<tool_call>` and `</tool_call>` are such tokens: plain text to the
model's tokenizer. A grammar that allows the text `<tool_call>` (a JSON string holding it, a
choice, a regex) then had llguidance offer the token in a mask and reject it once sampled, and
the request failed. So before llguidance reads the file, each non-special added token becomes an
ordinary vocabulary entry with the same id, spelled in the model's vocabulary alphabet. Its
bytes are then its text: allowed wherever the text is, in masks and when consumed alike.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import orjson

SENTENCEPIECE_SPACE = "\u2581"


@cache
def _byte_level_chars() -> tuple[str, ...]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other
    bytes for the code points from 256 upward, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = [], 256
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(extra))
            extra += 1
    return tuple(chars)


def _is_byte_level(data: dict[str, Any]) -> bool:
    decoder = data.get("decoder") or {}
    parts = (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


def vocab_piece(text: str, byte_level: bool) -> str:
    """How a BPE vocabulary spells text: byte-level alphabet, or SentencePiece's space mark."""
    if byte_level:
        chars = _byte_level_chars()
        return "".join(chars[b] for b in text.encode())
    return text.replace(" ", SENTENCEPIECE_SPACE)


def grammar_tokenizer_json(text: str) -> str:
    """tokenizer.json with its non-special added tokens moved into the BPE vocabulary (same
    ids); unchanged where there are none or the model is not BPE."""
    data = orjson.loads(text)
    model = data.get("model") or {}
    vocab = model.get("vocab")
    added = data.get("added_tokens") or []
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not added:
        return text
    byte_level = _is_byte_level(data)
    kept, moved = [], 0
    for tok in added:
        content, tid = tok.get("content"), tok.get("id")
        text_token = not tok.get("special", True) and isinstance(content, str) and isinstance(tid, int)
        if not text_token or not content:
            kept.append(tok)
            continue
        piece = vocab_piece(content, byte_level)
        if vocab.get(piece, tid) != tid:  # the spelling names another token: leave this one be
            kept.append(tok)
            continue
        vocab[piece] = tid
        moved += 1
    if not moved:
        return text
    data["added_tokens"] = kept
    return orjson.dumps(data).decode()
