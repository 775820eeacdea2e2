"""A chat completions body read once into ChatBody: what the chat route works from."""

from __future__ import annotations

import pytest

from vt.http.chat_body import fields_given, parse_chat_body
from vt.http.protocol import ProtocolError

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}


def test_a_plain_body() -> None:
    chat = parse_chat_body({"messages": USER, "max_tokens": 5}, auto_tool_choice=False)
    assert chat.request.messages == ({"role": "user", "content": "hi"},)
    assert chat.template.add_generation_prompt
    assert chat.tools.mode == "none" and chat.constraint is None
    assert (chat.echo, chat.include_reasoning) == (False, True)
    assert (chat.max_tokens_param, chat.max_tokens_given) == ("max_tokens", True)
    assert (chat.reply_role, chat.echoed) == ("assistant", "")


def test_max_completion_tokens_names_the_limit_and_nulls_count_as_unset() -> None:
    chat = parse_chat_body({"messages": USER, "max_completion_tokens": 7, "temperature": None},
                           auto_tool_choice=False)
    assert (chat.max_tokens_param, chat.max_tokens_given) == ("max_completion_tokens", True)
    assert "temperature" not in chat.given
    assert fields_given({"a": 1, "b": None, "c": False}) == {"a", "c"}


def test_echo_repeats_the_final_message_only_when_the_reply_continues_it() -> None:
    messages = [*USER, {"role": "assistant", "content": "Sure"}]
    continued = parse_chat_body({"messages": messages, "echo": True, "add_generation_prompt": False,
                                 "continue_final_message": True}, auto_tool_choice=False)
    assert (continued.reply_role, continued.echoed) == ("assistant", "Sure")
    opened = parse_chat_body({"messages": USER, "echo": True}, auto_tool_choice=False)
    assert (opened.reply_role, opened.echoed) == ("assistant", "")


def test_required_tools_constrain_the_output_and_exclude_a_structured_output() -> None:
    chat = parse_chat_body({"messages": USER, "tools": [TOOL], "tool_choice": "required"},
                           auto_tool_choice=False)
    assert chat.tools.mode == "required"
    assert chat.constraint is not None and chat.constraint.param == "tools"
    with pytest.raises(ProtocolError) as e:
        parse_chat_body({"messages": USER, "tools": [TOOL], "tool_choice": "required",
                         "response_format": {"type": "json_object"}}, auto_tool_choice=False)
    assert e.value.param == "response_format"


@pytest.mark.parametrize("field, value", [("echo", "yes"), ("include_reasoning", 1), ("tools", {})])
def test_a_wrong_type_names_its_field(field: str, value: object) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_chat_body({"messages": USER, field: value}, auto_tool_choice=False)
    assert e.value.param == field
