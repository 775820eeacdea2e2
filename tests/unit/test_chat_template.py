"""Chat prompts equal transformers' apply_chat_template, text and token ids, on a Qwen3-like
template (thinking switch, tools, multi-turn with reasoning and tool turns), for every control a
request can set: add_generation_prompt, continue_final_message, chat_template_kwargs, a
replacement template; and `--chat-template` values."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from vt.model.make_model import make_model
from vt.text.chat_template import ChatTemplateError, load_chat_template
from vt.text.tokenizer import Tokenizer

TEMPLATE_FILE = Path(__file__).resolve().parents[1] / "templates" / "qwen3_like.jinja"
TEMPLATE = TEMPLATE_FILE.read_text()

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is the weather in Paris?"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MULTI_TURN = [SYSTEM, {"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
              {"role": "user", "content": "And 3+3?"}]
TOOL_TURN = [USER, {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]
CONTINUE = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
CONTINUE_CONTROLS = {"add_generation_prompt": False, "continue_final_message": True}

CASES = {
    "plain": (MULTI_TURN[1:2], {}),
    "thinking off": (MULTI_TURN[1:2], {"enable_thinking": False}),
    "system and tools": ([SYSTEM, USER], {"tools": TOOLS}),
    "multi-turn": (MULTI_TURN, {}),
    "multi-turn, thinking off": (MULTI_TURN, {"enable_thinking": False}),
    "tool call and response": (TOOL_TURN, {"tools": TOOLS}),
    "no generation prompt": (MULTI_TURN, {"add_generation_prompt": False}),
    "continue the final message": (CONTINUE, CONTINUE_CONTROLS),
    "continue after a space": ([CONTINUE[0], {"role": "assistant", "content": "One, two, "}],
                               CONTINUE_CONTROLS),
    "reasoning field": ([*MULTI_TURN[:2], {"role": "assistant", "content": "4", "reasoning_content": "sum"},
                         {"role": "assistant", "content": "Done."}], {"add_generation_prompt": False}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_model(tmp_path_factory.mktemp("chat") / "m")
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def theirs(model_dir: Path):
    return AutoTokenizer.from_pretrained(str(model_dir))


def _ours(tok: Tokenizer, messages: list[dict], controls: dict) -> str:
    controls = dict(controls)
    return tok.apply_chat_template(
        messages, add_generation_prompt=controls.pop("add_generation_prompt", True),
        continue_final_message=controls.pop("continue_final_message", False),
        tools=controls.pop("tools", None), chat_template=controls.pop("chat_template", None),
        variables=controls)


def _theirs(tok, messages: list[dict], controls: dict, tokenize: bool = False):
    controls = {"add_generation_prompt": True, **controls}
    return tok.apply_chat_template(messages, tokenize=tokenize, return_dict=False, **controls)


@pytest.mark.parametrize("case", CASES)
def test_prompt_text_and_ids_equal_transformers(ours, theirs, case):
    messages, controls = CASES[case]
    text = _ours(ours, messages, controls)
    assert text == _theirs(theirs, messages, controls)
    assert ours.encode(text, add_special_tokens=False) == _theirs(theirs, messages, controls, tokenize=True)


def test_the_controls_change_the_prompt(ours):
    user = MULTI_TURN[1:2]
    thinking_off = _ours(ours, user, {"enable_thinking": False})
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _ours(ours, user, {}).endswith("<|im_start|>assistant\n")
    assert '"name": "get_weather"' in _ours(ours, [USER], {"tools": TOOLS})
    assert not _ours(ours, MULTI_TURN, {"add_generation_prompt": False}).endswith("assistant\n")
    assert _ours(ours, CONTINUE, CONTINUE_CONTROLS).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nOne, two,")


def test_a_replacement_template_is_rendered_instead(ours, theirs):
    other = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ greeting }}"
    controls = {"chat_template": other, "greeting": "hello"}
    assert _ours(ours, MULTI_TURN, controls) == _theirs(theirs, MULTI_TURN, controls)
    assert _ours(ours, MULTI_TURN, controls).endswith("[user] And 3+3?\nhello")


def test_bad_controls_are_chat_template_errors(ours):
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        _ours(ours, CONTINUE, {"continue_final_message": True})
    with pytest.raises(ChatTemplateError, match="final message"):
        _ours(ours, [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
              {"add_generation_prompt": False, "continue_final_message": True})
    with pytest.raises(ChatTemplateError, match="unknown role"):
        _ours(ours, [{"role": "wizard", "content": "x"}], {})
    with pytest.raises(ChatTemplateError, match="compile"):
        _ours(ours, CONTINUE, {"chat_template": "{% for %}"})


def test_chat_template_flag_reads_a_file_or_the_template_itself(tmp_path):
    assert load_chat_template(str(TEMPLATE_FILE)) == TEMPLATE
    # a template given inline, with the shell's literal backslash escapes read as vLLM reads them
    inline = r"{{ messages[0].content }}\n{{ 'é' }}"
    assert load_chat_template(inline) == "{{ messages[0].content }}\n{{ 'é' }}"
    with pytest.raises(ChatTemplateError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_a_checkpoint_without_a_template_says_how_to_give_one(tmp_path):
    path = make_model(tmp_path / "m")
    cfg = (path / "tokenizer_config.json").read_text()
    (path / "tokenizer_config.json").write_text(cfg.replace('"chat_template"', '"unused_template"'))
    tok = Tokenizer.from_dir(path)
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        tok.apply_chat_template([USER])
    assert tok.apply_chat_template([USER], chat_template=TEMPLATE).startswith("<|im_start|>user\n")
