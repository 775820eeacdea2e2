"""Tokenizer loading, chat templates and the streaming detokenizer with stop strings."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from vt.model.make_model import make_model
from vt.text.tokenizer import ChatTemplateError, DetokStream, Tokenizer

TEXT = "Hello wörld, 鱻🦀 naïve 龘𝄞 test 👩‍💻 done."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tok") / "m", preset="tiny")


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


def _stream(tok, ids, prompt=(), **kw):
    d = DetokStream(tok, list(prompt), **kw)
    parts = [d.push(i) for i in ids]
    return d, parts


# ---- loading ---------------------------------------------------------------------------------

def test_loads_ids_and_special_tokens(tok):
    end, start, eot = (tok.token_to_id(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"))
    assert tok.eos_token_ids == frozenset({end, eot})  # tokenizer_config + generation_config
    assert {end, start, eot} <= tok.special_ids
    assert tok.vocab_size >= 900
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.decode([start] + ids + [end], skip_special_tokens=True) == TEXT
    assert tok.decode([start, end], skip_special_tokens=False) == "<|im_start|><|im_end|>"


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _variant(model_dir, tmp_path, tok_cfg, extra=None):
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    for name, content in (extra or {}).items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return Tokenizer.from_dir(tmp_path)


def test_eos_ids_bos_and_template_variants(model_dir, tmp_path):
    t = _variant(model_dir, tmp_path,
                 {"bos_token": {"content": "<|endoftext|>"}, "add_bos_token": True,
                  "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                                    {"name": "default", "template": "{{ bos_token }}D"}]},
                 {"generation_config.json": {"eos_token_id": 7}, "config.json": {"eos_token_id": [8, 9]}})
    assert t.eos_token_ids == frozenset({7, 8, 9})
    eot = t.token_to_id("<|endoftext|>")
    assert t.encode("hi")[0] == eot and t.encode("hi", add_special_tokens=False)[0] != eot
    assert t.apply_chat_template([]) == "<|endoftext|>D"
    (tmp_path / "chat_template.jinja").write_text("FILE{{ messages|length }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE1"


# ---- chat template -------------------------------------------------------------------------

def test_chatml_template_renders_turns_and_generation_prompt(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 鱻"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 鱻<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert no_prompt.endswith("Hi 鱻<|im_end|>\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\nab<|im_end|>" in tok.apply_chat_template(parts)


def test_template_errors_are_chat_template_errors(model_dir, tmp_path, tok):
    with pytest.raises(ChatTemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template("not a list")
    bad = _variant(model_dir, tmp_path, {"chat_template": "{% for %}"})
    with pytest.raises(ChatTemplateError, match="compile"):
        bad.apply_chat_template([])
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    sandboxed = _variant(model_dir, tmp_path, {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(ChatTemplateError):
        sandboxed.apply_chat_template([])


# ---- detokenizer ---------------------------------------------------------------------------

def test_multibyte_characters_split_across_tokens_never_stream_broken(tok):
    ids = tok.encode(TEXT)
    # the test is only meaningful if some character really spans tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d, parts = _stream(tok, ids, prompt=tok.encode("prompt: "))
    assert all("\ufffd" not in p for p in parts)
    tail = d.flush()
    assert "".join(parts) + tail == TEXT == d.text
    assert d.stop_str is None


@pytest.mark.parametrize("fast", [True, False])
def test_a_prompt_ending_inside_a_character_never_leaks_into_the_output(tok, fast):
    """Random-id prompts can end with part of a UTF-8 sequence: the output is the text of the
    output tokens, never characters of the prompt again, and never characters lost."""
    ids = tok.encode(TEXT)
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert len(cuts) >= 3  # the test is only meaningful if prompts really end mid-character
    for k in cuts:
        d = DetokStream(tok, ids[:k])
        if not fast:
            d._fast = None
        got = "".join(d.push(i) for i in ids[k:]) + d.flush()
        assert got == tok.decode(ids[k:]), k


def test_random_ids_stream_equals_full_decode(tok):
    rng = np.random.default_rng(3)
    for _ in range(20):
        ids = rng.integers(0, tok.vocab_size + 20, size=40).tolist()  # includes ids past the vocab
        for skip in (True, False):
            d, parts = _stream(tok, ids, prompt=[1, 5], skip_special_tokens=skip)
            assert "".join(parts) + d.flush() == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_spanning_tokens_is_cut_exactly(tok):
    text = "The answer is 42. ENDSTOP trailing words"
    ids = tok.encode(text)
    assert not any("ENDSTOP" in tok.decode([i]) for i in ids)  # spans several tokens
    for include, expect in ((False, "The answer is 42. "), (True, "The answer is 42. ENDSTOP")):
        d, parts = _stream(tok, ids, stop=("ENDSTOP", "never"), include_stop_str_in_output=include)
        assert d.stop_str == "ENDSTOP"
        assert "".join(parts) == expect == d.text
        assert d.push(ids[0]) == "" and d.flush() == ""
        # nothing after the stop was streamed, and nothing of the stop before it was reached
        stop_at = next(i for i, p in enumerate(parts) if i and "".join(parts[:i + 1]) == expect)
        assert all(p == "" for p in parts[stop_at + 1:])


def test_stop_string_with_multibyte_character(tok):
    ids = tok.encode("abc 鱻🦀 xyz")
    d, parts = _stream(tok, ids, stop=("🦀",))
    assert d.stop_str == "🦀" and d.text == "abc 鱻"
    d, parts = _stream(tok, ids, stop=("🦀",), include_stop_str_in_output=True)
    assert d.text == "abc 鱻🦀"


def test_earliest_stop_wins_and_holdback_is_released_by_flush(tok):
    ids = tok.encode("one two three four")
    d, _ = _stream(tok, ids, stop=("four", "two"))
    assert d.stop_str == "two" and d.text == "one "
    d, parts = _stream(tok, ids, stop=("absent-stop",))
    streamed = "".join(parts)
    assert len(streamed) <= len("one two three four") - (len("absent-stop") - 1)
    assert streamed + d.flush() == "one two three four"


def test_special_tokens_in_stream(tok):
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("hi") + [end]
    d, _ = _stream(tok, ids)
    assert d.text + d.flush() == "hi"
    d, parts = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(parts) + d.flush() == "hi<|im_end|>"


def _python_window(d: DetokStream) -> DetokStream:
    d._fast = None  # the window in Python only, as where tokenizers has no DecodeStream
    return d


def _metaspace_tokenizer() -> Tokenizer:
    """A sentencepiece-style tokenizer (Metaspace, byte fallback, a decoder that strips the
    leading space): the kind whose decodes depend most on context."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from vt.model.make_model import training_corpus

    hf = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    hf.train_from_iterator(training_corpus(400), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + bytes_, limit_alphabet=60,
        show_progress=False))
    spec = json.loads(hf.to_str())  # the byte tokens stay in the vocabulary, as ordinary tokens
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    return Tokenizer(HFTokenizer.from_str(json.dumps(spec)), eos_token="</s>")


@pytest.mark.parametrize("which", ["byte_level", "metaspace"])
def test_rust_and_python_windows_stream_the_same_chunks(tok, which):
    t = tok if which == "byte_level" else _metaspace_tokenizer()
    rng = np.random.default_rng(7)
    samples = [t.encode(TEXT), t.encode("abc 鱻🦀 xyz one two")]
    samples += [rng.integers(0, t.vocab_size + 5, size=60).tolist() for _ in range(15)]
    for ids in samples:
        for skip in (True, False):
            for prompt in ((), t.encode("prompt: ")):
                fast = DetokStream(t, list(prompt), skip_special_tokens=skip, stop=("xyz",))
                assert fast._fast is not None
                slow = _python_window(DetokStream(t, list(prompt), skip_special_tokens=skip, stop=("xyz",)))
                assert [fast.push(i) for i in ids] == [slow.push(i) for i in ids]
                assert fast.flush() == slow.flush() and fast.stop_str == slow.stop_str


def test_a_stream_the_rust_side_rejects_goes_on_in_python(tok):
    class Refuses:
        def step(self, *_):
            raise RuntimeError("InvalidPrefix")

    ids = tok.encode(TEXT)
    d = DetokStream(tok, tok.encode("prompt: "))
    parts = [d.push(i) for i in ids[:5]]
    d._fast = Refuses()
    parts += [d.push(i) for i in ids[5:]]
    assert d._fast is None
    assert "".join(parts) + d.flush() == TEXT
