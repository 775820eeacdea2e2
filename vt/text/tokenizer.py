"""Tokenizer (HF tokenizer.json + chat template in a jinja2 sandbox) and the incremental detokenizer.

Chat prompts: the rendered template already holds any BOS it wants, so encode it with
`add_special_tokens=False`, as Hugging Face does.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from vt.text.chat_template import (
    ChatTemplateError,
    TemplateCache,
    check_controls,
    check_template,
    render_chat,
)

__all__ = ["ChatTemplateError", "DetokStream", "Tokenizer"]

log = logging.getLogger("vt.text")
REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6  # prompt tail the detokenizer decodes with, for context-dependent decoders
_GIL_FREE_CHARS = 4096  # longer texts (token lists) are en/decoded by calls that release the GIL


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(tok: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{name, template}, ...]: the "default" one
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


class Tokenizer:
    """Encode / decode / chat template over a Hugging Face `tokenizers` tokenizer."""

    def __init__(self, tok: Any, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, add_bos_token: bool = False,
                 extra_eos_ids: Iterable[int] = ()) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        eos = set(extra_eos_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        added = tok.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # id -> text of every added token (special or not), for spaces_between_special_tokens
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self._templates = TemplateCache()
        # Templates rendered in this process: the model's and those trust_chat_template() checked.
        # Any other (a request's own) renders in a bounded child process (template_process.py).
        self._trusted: set[str] = set()
        self._template_processes: Any = None
        self.chat_template_problem: str | None = None
        if chat_template:
            self.chat_template_problem = self.trust_chat_template(chat_template)
            if self.chat_template_problem is not None:
                log.warning("the model's chat template cannot render a plain conversation, so chat requests "
                            "will fail: %s", self.chat_template_problem)
        self._encode_batch = getattr(tok, "encode_batch_fast", None) or getattr(tok, "encode_batch", None)
        self._decode_batch = getattr(tok, "decode_batch", None)
        try:  # tokenizers >= 0.21 streams decodes in Rust; older ones use DetokStream's own window
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers.decoders import DecodeStream
        except ImportError:
            DecodeStream = HFTokenizer = None  # noqa: N806
        self._decode_stream_cls = DecodeStream if HFTokenizer and isinstance(tok, HFTokenizer) else None

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {d}")
        tok = HFTokenizer.from_file(str(path))
        cfg = _read_json(d / "tokenizer_config.json")
        template = _pick_template(cfg.get("chat_template"))
        jinja_file = d / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        eos_ids = _id_list(_read_json(d / "generation_config.json").get("eos_token_id"))
        eos_ids += _id_list(_read_json(d / "config.json").get("eos_token_id"))
        return cls(tok, chat_template=template, bos_token=_token_content(cfg.get("bos_token")),
                   eos_token=_token_content(cfg.get("eos_token")),
                   pad_token=_token_content(cfg.get("pad_token")),
                   add_bos_token=bool(cfg.get("add_bos_token", False)), extra_eos_ids=eos_ids)

    # ---- ids <-> text --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS and self._encode_batch is not None:
            # encode holds the GIL throughout; encode_batch lets other threads run meanwhile
            enc = self._encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        ids = list(enc.ids)
        # tokenizer.json's post-processor may already add BOS; add it only where it did not
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _GIL_FREE_CHARS and self._decode_batch is not None:
            # as for encode: the batch call lets other threads run while it works
            return self._decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def raw(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool) -> Any | None:
        """A `tokenizers` DecodeStream primed with context_ids, or None where the installed
        tokenizers has none (or cannot prime one)."""
        if self._decode_stream_cls is None:
            return None
        try:
            return self._decode_stream_cls(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except TypeError:
            return None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # ---- chat template -------------------------------------------------------------------
    def _special_tokens(self) -> dict[str, str]:
        return {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                "pad_token": self.pad_token or ""}

    def trust_chat_template(self, source: str) -> str | None:
        """Render `source` in this process from now on (the model's template, or the server's
        --chat-template) if it compiles and renders a plain conversation within its bound;
        otherwise it stays in the bounded child process and the reason why is returned."""
        try:
            problem = check_template(self._templates.get(source), self._special_tokens())
        except ChatTemplateError as e:
            problem = str(e)
        if problem is None:
            self._trusted.add(source)
        return problem

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            chat_template: str | None = None, variables: dict[str, Any] | None = None,
                            **kwargs: Any) -> str:
        """The prompt text of a chat, as transformers renders it: `chat_template` replaces the
        model's own; `variables` (and kwargs) reach the template beside the special tokens.
        ChatTemplateError for anything the template does wrong; its `param` is "chat_template"
        where the template is one this process does not trust (a request's own), which is
        rendered in a child process bounded in time and memory."""
        source = chat_template or self.chat_template
        if not source:
            raise ChatTemplateError(
                "this model has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja); use the completions endpoint or provide a template "
                "(vt serve --chat-template)")
        variables = {**self._special_tokens(), **kwargs, **(variables or {})}
        check_controls(messages, add_generation_prompt, continue_final_message)
        try:
            if source in self._trusted:
                return render_chat(self._templates.get(source), messages,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tools=tools,
                                   variables=variables)
            if self._template_processes is None:
                from vt.text.template_process import TemplateProcesses

                self._template_processes = TemplateProcesses()
            return self._template_processes.render(
                source, messages, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, variables=variables)
        except ChatTemplateError as e:
            if source != self.chat_template or not str(e).startswith("chat template"):
                raise
            # the model's own template failed: not the request's template, say whose it is
            raise ChatTemplateError(f"{e} (the model's chat template)", "messages") from None


class DetokStream:
    """Incremental detokenizer for one sequence, with stop strings.

    Keeps a small decode window (prefix/read offsets): each push decodes only the tokens since
    the last emitted text plus a few before it, so a token costs O(1) whatever the output length.
    Text is held back while the window ends in an incomplete UTF-8 sequence (decodes to U+FFFD),
    and, with stop strings, the last len(longest stop) - 1 characters are held back so a stop
    string arriving across tokens is never partly streamed.

    spaces_between_special_tokens false (with special tokens kept) is vLLM's detokenizer option:
    an added token that follows another added token is its own text, without the space a
    decoder may put between them.

    min_tokens holds stop strings back as vLLM's detokenizer does: none is looked for until more
    than min_tokens tokens are out, and then only where it ends in text those later tokens add
    (it may begin in the text before).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 spaces_between_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self._tok = tokenizer
        self._min_tokens = min_tokens
        self._pushed = 0  # tokens pushed: stop strings are looked for once there are more than min_tokens
        self._stop_from = 0  # characters of pending text no stop string may end in (min_tokens' text)
        self._skip = skip_special_tokens
        # As vLLM: the option only matters where special tokens are kept and the tokenizer has any.
        glued = not (skip_special_tokens or spaces_between_special_tokens)
        self._added: dict[int, str] | None = getattr(tokenizer, "added_tokens", None) if glued else None
        self._last_added = False
        self._stops = tuple(stop)
        self._include = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        # A prompt that ends inside a character (its last tokens carry part of a UTF-8 sequence)
        # would let the window's offsets split that character: decode the output against the
        # prompt's complete characters only, so the first text is the whole character it ends.
        while self._ids and tokenizer.decode(self._ids, skip_special_tokens=skip_special_tokens) \
                .endswith(REPLACEMENT_CHAR):
            self._ids.pop()
        self._prefix = 0                    # window start (context tokens, already emitted)
        self._read = len(self._ids)         # tokens before this are decoded and accounted for
        self._pending = ""                  # decoded text held back for stop matching
        self._parts: list[str] = []
        self.stop_str: str | None = None
        # The same prefix/read window, kept in Rust: one call a token instead of two decodes and
        # the list slicing around them (~1 us against ~3.3 us). The Python window above follows
        # it, so a stream the Rust side rejects (it raises when a decoder rewrites the prefix)
        # goes on in Python from the same place.
        make = getattr(tokenizer, "decode_stream", None)
        self._fast = make(self._ids, skip_special_tokens) if make is not None else None
        self._raw = tokenizer.raw if self._fast is not None else None

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _decode_new(self) -> str:
        """Text the tokens since read_offset add, or "" while it ends in an incomplete character."""
        if self._fast is not None:
            try:
                new = self._fast.step(self._raw, self._ids[-1])
            except Exception:
                self._fast = None
            else:
                if new is None:
                    return ""
                self._prefix, self._read = self._read, len(self._ids)
                self._trim()
                return new
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        self._trim()
        return full[len(prefix_text):]

    def _trim(self) -> None:
        # drop tokens before the window so memory stays bounded on long generations
        if self._prefix > 64:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _emit(self, s: str) -> str:
        if s:
            self._parts.append(s)
        return s

    def _find_stop(self) -> tuple[int, str] | None:
        """Earliest-ending stop string in pending text (ties: the longer one), as a character
        stream would meet it, so the result does not depend on how text splits into tokens."""
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            i = self._pending.find(s, max(0, self._stop_from - len(s) + 1))
            if i < 0:
                continue
            key = (i + len(s), -len(s), s)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        end, neg_len, s = best
        return end + neg_len, s

    def push(self, token_id: int) -> str:
        """Add one sampled token; returns the text safe to stream now ("" after a stop)."""
        if self.stop_str is not None:
            return ""
        self._pushed += 1
        self._ids.append(int(token_id))
        new = self._decode_new()
        if self._added:
            content = self._added.get(int(token_id))
            if content is not None and self._last_added and new:
                new = content  # the previous token was added too, so its text is whole: no space
            self._last_added = content is not None
        if not new:
            return ""
        self._pending += new
        if self._stops and self._pushed <= self._min_tokens:
            self._stop_from = len(self._pending)
        elif self._stops:
            found = self._find_stop()
            if found is not None:
                start, s = found
                self.stop_str = s
                cut = start + len(s) if self._include else start
                out, self._pending = self._pending[:cut], ""
                return self._emit(out)
        n = len(self._pending) - self._hold
        if n <= 0:
            return ""
        out, self._pending = self._pending[:n], self._pending[n:]
        self._stop_from = max(0, self._stop_from - n)
        return self._emit(out)

    def flush(self) -> str:
        """Everything held back (at a finish other than a stop string); "" after a stop."""
        if self.stop_str is not None:
            return ""
        tail = self._decode(self._ids[self._prefix:])[len(self._decode(self._ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self._ids)
        out, self._pending = self._pending + tail, ""
        return self._emit(out)
