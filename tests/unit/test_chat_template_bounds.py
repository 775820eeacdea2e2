"""Chat templates harm no one: compiling one costs what its source's size does (no constant
folding), a request's own template renders in a child process bounded in time and memory, and
whatever a template does wrong is a ChatTemplateError (a 400) with a one-line reason, whether it
is the request's template or the model's, which is checked when the tokenizer is built."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from vt.model.make_model import make_model
from vt.text.chat_template import ChatTemplateError, TemplateCache
from vt.text.template_process import RENDER_MAX_MEMORY, RENDER_TIMEOUT_S
from vt.text.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Hello"}]
GROWTH_BOUND = 64 << 20      # this process's resident growth allowed around one bad template
BOUND_S = RENDER_TIMEOUT_S + 1.5  # a bounded render's answer, with the child's start and a kill

# Constant expressions Jinja folded while compiling (outside any render's guard), and ranges.
COMPILE_BOMBS = {
    "repeat": "{{ 'x' * 10**9 }}",
    "repeat of a literal": "{{ 'x' * 1000000000 }}",
    "list repeat": "{{ [0, 1] * 10**9 }}",
    "power": "{{ 7 ** 100000000 }}",
    "percent width": "{{ '%0999999999d' % 1 }}",
    "center": "{{ 'x'|center(999999999) }}",
    "format filter": "{{ '%0999999999d'|format(1) }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "ljust": "{{ 'x'.ljust(999999999) }}",
    "big range": "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "range list": "{{ range(10**9)|list|length }}",
}
RUNTIME_ERRORS = {
    "division by zero": "{{ 1/0 }}",
    "modulo by zero": "{{ 1 % 0 }}",
    "undefined attribute": "{{ messages[0].nope.deeper }}",
    "undefined call": "{{ nope() }}",
    "type error": "{{ 'a' + 1 }}",
    "raise_exception": "{{ raise_exception('only user turns') }}",
    "bad syntax": "{% for %}",
    "huge literal": "{{ " + "9" * 5000 + " }}",
}


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("bounds") / "m")


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize("name", COMPILE_BOMBS)
def test_compiling_folds_no_constant(name):
    before, start = _rss(), time.monotonic()
    TemplateCache().get(COMPILE_BOMBS[name])
    assert time.monotonic() - start < 1.0
    assert _rss() - before < GROWTH_BOUND


@pytest.mark.parametrize("name", COMPILE_BOMBS)
def test_a_request_template_bomb_is_refused_within_its_bound(tok, name):
    before, start = _rss(), time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        tok.apply_chat_template(MESSAGES, chat_template=COMPILE_BOMBS[name])
    assert time.monotonic() - start < BOUND_S
    assert _rss() - before < GROWTH_BOUND
    assert e.value.param == "chat_template" and "\n" not in str(e.value)


@pytest.mark.parametrize("name", COMPILE_BOMBS)
def test_a_model_template_bomb_is_reported_and_refused(tok, name):
    # checked in this process when the tokenizer is built: the sandbox's bounds refuse it there
    before = _rss()
    bombed = Tokenizer(tok.raw, chat_template=COMPILE_BOMBS[name])
    assert bombed.chat_template_problem is not None
    with pytest.raises(ChatTemplateError):
        bombed.apply_chat_template(MESSAGES)
    assert _rss() - before < GROWTH_BOUND


@pytest.mark.parametrize("name", RUNTIME_ERRORS)
def test_runtime_errors_are_chat_template_errors(tok, name):
    source = RUNTIME_ERRORS[name]
    with pytest.raises(ChatTemplateError) as e:  # a request's template, in a child
        tok.apply_chat_template(MESSAGES, chat_template=source)
    assert e.value.param == "chat_template" and "\n" not in str(e.value)
    if name == "raise_exception":
        assert "only user turns" in str(e.value)
    cache = TemplateCache()  # and in this process, as a trusted template renders
    with pytest.raises(ChatTemplateError) as e:
        from vt.text.chat_template import render_chat

        render_chat(cache.get(source), MESSAGES, add_generation_prompt=True)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_a_looping_request_template_stops_at_its_time(tok):
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=f"more than {RENDER_TIMEOUT_S:g} s"):
        tok.apply_chat_template(MESSAGES, chat_template=loop)
    assert RENDER_TIMEOUT_S - 0.1 < time.monotonic() - start < BOUND_S


def test_one_long_c_call_is_stopped_at_its_time(tok):
    # a single call that never returns to Python code: the parent kills its child
    quadratic = "{{ ([[0] * 1000] * 100000)|sum(start=[])|length }}"
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="more than"):
        tok.apply_chat_template(MESSAGES, chat_template=quadratic)
    assert time.monotonic() - start < BOUND_S
    assert tok.apply_chat_template(MESSAGES, chat_template="{{ messages[0].content }}") == "Hello"


def test_a_request_template_past_its_memory_is_refused(tok):
    grow = ("{% set s = 'x' * 16000000 %}{% set ns = namespace(l=[]) %}"
            "{% for i in range(64) %}{% set ns.l = ns.l + [s ~ i] %}{% endfor %}{{ ns.l|length }}")
    before = _rss()
    with pytest.raises(ChatTemplateError, match=f"{RENDER_MAX_MEMORY >> 20} MiB"):
        tok.apply_chat_template(MESSAGES, chat_template=grow)
    assert _rss() - before < GROWTH_BOUND
    assert tok.apply_chat_template(MESSAGES, chat_template="{{ messages[0].content }}") == "Hello"


def test_a_slow_request_template_holds_up_no_other(tok):
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    tok.apply_chat_template(MESSAGES, chat_template="{{ 1 }}")  # a child started
    slow = threading.Thread(target=lambda: pytest.raises(ChatTemplateError, tok.apply_chat_template,
                                                         MESSAGES, chat_template=loop))
    slow.start()
    try:
        time.sleep(0.2)
        start = time.monotonic()
        assert tok.apply_chat_template(MESSAGES, chat_template="{{ messages[0].role }}") == "user"
        assert time.monotonic() - start < RENDER_TIMEOUT_S - 0.5  # answered while the loop runs
        assert slow.is_alive()
    finally:
        slow.join()


def test_a_broken_model_template_is_reported_when_the_tokenizer_is_built(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="vt.text"):
        tok = Tokenizer(Tokenizer.from_dir(model_dir).raw, chat_template="{{ messages[0].content / 0 }}")
    assert tok.chat_template_problem is not None and "TypeError" in tok.chat_template_problem
    assert any("chat template" in r.getMessage() for r in caplog.records)
    with pytest.raises(ChatTemplateError, match="the model's chat template"):
        tok.apply_chat_template(MESSAGES)
    fine = Tokenizer(tok.raw, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert fine.chat_template_problem is None
    assert fine.apply_chat_template(MESSAGES) == "Hello"


def test_a_trusted_template_renders_as_before(tok):
    other = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert tok.trust_chat_template(other) is None
    assert tok.apply_chat_template(MESSAGES, chat_template=other) == "[user] Hello\n"
    assert tok.trust_chat_template("{{ 1/0 }}") is not None  # refused: stays bounded in a child
