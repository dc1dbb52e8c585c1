"""Tool naming: OpenAI function names from (server, tool), sanitised, bounded and unique."""

from __future__ import annotations

import re

from flotilla.services.tools.connection import result_text
from flotilla.services.tools.registry import MAX_NAME_LEN, exposed_name, openai_tool

OPENAI_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # the function-name rule of the OpenAI API


def test_name_is_server_underscore_tool() -> None:
    assert exposed_name("weather", "get-forecast") == "weather_get-forecast"


def test_unsafe_characters_become_underscores() -> None:
    name = exposed_name("my.server", "do thing/now")
    assert name == "my_server_do_thing_now" and OPENAI_NAME.match(name)


def test_long_names_are_cut_and_stay_distinct() -> None:
    a = exposed_name("s" * 40, "t" * 40 + "a")
    b = exposed_name("s" * 40, "t" * 40 + "b")
    assert len(a) == len(b) == MAX_NAME_LEN and a != b
    assert OPENAI_NAME.match(a) and OPENAI_NAME.match(b)


def test_collisions_get_distinct_names() -> None:
    first = exposed_name("a.b", "c")
    second = exposed_name("a_b", "c", taken={first})
    assert first == "a_b_c" and second != first and OPENAI_NAME.match(second)


def test_openai_tool_shape() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    tool = openai_tool("s_t", {"name": "t", "description": "Does t.", "inputSchema": schema})
    assert tool == {"type": "function",
                    "function": {"name": "s_t", "description": "Does t.", "parameters": schema}}


def test_result_text_joins_text_parts() -> None:
    result = {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert result_text(result) == "a\nb"
    image = {"type": "image", "data": "AA==", "mimeType": "image/png"}
    assert '"image/png"' in result_text({"content": [image]})
