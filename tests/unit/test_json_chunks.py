"""JSON bodies in pieces: the same bytes as one orjson.dumps, lazy items built only when written."""

from __future__ import annotations

import orjson

from vt.http.json_chunks import LazyList, json_chunks


def test_pieces_join_to_the_materialized_document() -> None:
    built: list[int] = []

    def item(i: int) -> dict:
        built.append(i)
        return {"token": f"t{i}", "top": [[i, -1.5], [i + 1, -2.0]], "bytes": list(b"ab")}

    doc = {"id": "x", "choices": [{"index": 0, "logprobs": {"content": LazyList(5000, item)},
                                   "text": "é\n\"q\""}, {"index": 1, "logprobs": None}],
           "usage": {"total": 3}, "empty": [], "nothing": {}}
    chunks = json_chunks(doc, chunk_bytes=4096)
    first = next(chunks)
    assert len(first) >= 4096 and len(built) < 5000  # later items are not built yet
    rest = list(chunks)
    assert all(len(c) < 4096 + 200 for c in rest)
    doc["choices"][0]["logprobs"]["content"] = [item(i) for i in range(5000)]
    assert first + b"".join(rest) == orjson.dumps(doc)
