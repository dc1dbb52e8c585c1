"""How a model family writes tool calls: the text of a call, its call ids, and the grammar that
forces calls (tool_choice "required" or a named function).

Families and their formats (what the parser in tool_calls.py reads; it reads all of them, so a
model that strays into another family's format is still understood):
- hermes          `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>` (Qwen 2.5/3,
                  Hermes, and every model whose template ignores `tools`: tool_prompt.py teaches
                  them this format)
- mistral         `[TOOL_CALLS]N[ARGS]A` per call (Mistral Small 3.2, Devstral, Magistral;
                  optionally `N[CALL_ID]id[ARGS]A`); 9-character alphanumeric call ids
- mistral_list    `[TOOL_CALLS][{"name": N, "arguments": A}, ...]` (Mistral 7B v0.3, Nemo)
- llama3_json     `{"name": N, "parameters": A}` at the start of the reply, `; `-separated,
                  optionally after `<|python_tag|>` (Llama 3.1 / 3.2 / 3.3)
- llama_function  `<function=N>A</function>` (Llama 3.1 custom-tool prompting)
- json            `{"name": N, "arguments": A}` at the start of the reply (templates that read
                  `tools` with a format of their own we do not know)
XML formats (`XML_FORMATS`: arguments one parameter per tag, read by xml_tool_calls.py):
- glm             `<tool_call>N\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>`
                  (GLM-4.5 / 4.6 / 4.7)
- qwen_xml        `<tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>\n</function>\n
                  </tool_call>` (Qwen3-Coder, Qwen3.5, Qwen3-Next)
- minimax         `<minimax:tool_call>\n<invoke name="N">\n<parameter name="K">V</parameter>\n
                  </invoke>\n...</minimax:tool_call>` (MiniMax-M2: one block, several calls)
- dsml            `<｜DSML｜function_calls>\n<｜DSML｜invoke name="N">\n<｜DSML｜parameter
                  name="K" string="true|false">V</｜DSML｜parameter>\n</｜DSML｜invoke>\n...
                  </｜DSML｜function_calls>` (DeepSeek-V3.2)
For these and gemma4, a forced call (tool_choice) constrains the opening and the function name; the
arguments' text is free (the schema is not enforced by the grammar).
- pythonic        `[N(k="v", n=1), M()]` opening the reply (Llama 4, Llama 3.2 pythonic
                  prompts: read by pythonic_tool_calls.py)
- gemma4          `<|tool_call>call:N{K:V,...}<tool_call|>`, strings quoted `<|"|>` (Gemma 4:
                  read by gemma4_tool_calls.py)
- harmony         `<|channel|>commentary to=functions.N <|constrain|>json<|message|>A<|call|>`
                  (gpt-oss: replies are read by harmony.py; this format is what a forced call
                  writes, the model's reasoning skipped)
`detect` picks the family from the chat template's text.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from flotilla.services.tokenizer.gemma4_tool_calls import write_value

_ALNUM = string.ascii_letters + string.digits
Structure = dict[str, Any]


def _json_args(schema: Any) -> Structure:
    if not isinstance(schema, dict) or not schema:
        schema = {"type": "object"}
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


@dataclass(frozen=True)
class ToolFormat:
    """One family's call syntax: `begin` + arguments JSON + `end` per call, `separator` between
    calls, the whole list between `opening` and `closing`. In `begin`, `{name}` is the function
    name."""

    name: str
    begin: str
    end: str = ""
    separator: str = ""
    opening: str = ""
    closing: str = ""
    id_style: Literal["openai", "mistral"] = "openai"
    markers: tuple[str, ...] = ()  # format texts that are control tokens in the family's vocab
    xml: bool = False  # arguments not written as JSON (XML formats, Gemma 4)

    def new_call_id(self) -> str:
        if self.id_style == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"

    def _begin(self, name: str) -> str:
        return self.begin.replace("{name}", name)  # names are [A-Za-z0-9_.-]: no escaping

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON text) written as the model writes them."""
        body = self.separator.join(self._begin(n) + self._args(args) + self.end
                                   for n, args in calls)
        return self.opening + body + self.closing

    def _args(self, args: str) -> str:
        """Arguments as written: JSON text, or for XML formats one tag per parameter, strings
        as they are and other values as JSON (as their chat templates write them)."""
        if self.name == "pythonic":
            return ", ".join(f"{k}={v!r}" for k, v in json.loads(args).items())
        if self.name == "gemma4":
            return ",".join(f"{k}:{write_value(v)}" for k, v in sorted(json.loads(args).items()))
        if not self.xml:
            return args
        values = json.loads(args)
        parts = []
        for key, value in values.items():
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            parts.append(_PARAM[self.name].format(key=key, text=text, string=str(
                isinstance(value, str)).lower()))
        return "".join(parts)

    def structural_tag(self, tools: list[dict[str, Any]], single: bool) -> Structure:
        """xgrammar structural tag: at least one call (exactly one when `single`) of one of
        `tools`, arguments following the tool's parameters schema, nothing else."""
        tags = [{"type": "tag", "begin": self._begin(t["function"]["name"]),
                 "content": {"type": "any_text"} if self.xml else _json_args(
                     t["function"].get("parameters")), "end": self.end}
                for t in tools]
        calls: Structure = {"type": "tags_with_separator", "tags": tags,
                            "separator": self.separator, "at_least_one": True,
                            "stop_after_first": single}
        elements = [{"type": "const_string", "value": self.opening}] if self.opening else []
        elements.append(calls)
        if self.closing:
            elements.append({"type": "const_string", "value": self.closing})
        fmt = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
        return {"type": "structural_tag", "format": fmt}


HERMES = ToolFormat("hermes", '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>",
                    separator="\n", markers=("<tool_call>", "</tool_call>"))
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]{name}[ARGS]", id_style="mistral",
                     markers=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))
MISTRAL_LIST = ToolFormat("mistral_list", '{"name": "{name}", "arguments": ', "}",
                          separator=", ", opening="[TOOL_CALLS][", closing="]",
                          id_style="mistral", markers=("[TOOL_CALLS]",))
LLAMA3_JSON = ToolFormat("llama3_json", '{"name": "{name}", "parameters": ', "}",
                         separator="; ", markers=("<|python_tag|>",))
LLAMA_FUNCTION = ToolFormat("llama_function", "<function={name}>", "</function>")
JSON = ToolFormat("json", '{"name": "{name}", "arguments": ', "}", separator=", ",
                  opening="[", closing="]")
FORMATS = {f.name: f for f in (HERMES, MISTRAL, MISTRAL_LIST, LLAMA3_JSON, LLAMA_FUNCTION, JSON)}
GLM = ToolFormat("glm", "<tool_call>{name}\n", "</tool_call>", separator="\n", xml=True,
                 markers=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                          "</arg_value>"))
QWEN_XML = ToolFormat("qwen_xml", "<tool_call>\n<function={name}>\n", "</function>\n</tool_call>",
                      separator="\n", xml=True, markers=("<tool_call>", "</tool_call>"))
MINIMAX = ToolFormat("minimax", '<invoke name="{name}">\n', "</invoke>\n",
                     opening="<minimax:tool_call>\n", closing="</minimax:tool_call>", xml=True,
                     markers=("<minimax:tool_call>", "</minimax:tool_call>"))
_DSML = "｜DSML｜"
DSML = ToolFormat("dsml", f'<{_DSML}invoke name="{{name}}">\n', f"</{_DSML}invoke>\n",
                  opening=f"<{_DSML}function_calls>\n", closing=f"</{_DSML}function_calls>",
                  xml=True)
XML_FORMATS = {f.name: f for f in (GLM, QWEN_XML, MINIMAX, DSML)}
_PARAM = {"glm": "<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>\n",
          "qwen_xml": "<parameter={key}>\n{text}\n</parameter>\n",
          "minimax": '<parameter name="{key}">{text}</parameter>\n',
          "dsml": f'<{_DSML}parameter name="{{key}}" string="{{string}}">{{text}}'
                  f"</{_DSML}parameter>\n"}
PYTHONIC = ToolFormat("pythonic", "{name}(", ")", separator=", ", opening="[", closing="]",
                      xml=True)
GEMMA4 = ToolFormat("gemma4", "<|tool_call>call:{name}{", "}<tool_call|>", xml=True,
                    markers=("<|tool_call>", "<tool_call|>", '<|"|>'))
HARMONY = ToolFormat("harmony", "<|channel|>commentary to=functions.{name} <|constrain|>json"
                     "<|message|>", "<|call|>", markers=("<|channel|>", "<|constrain|>",
                                                         "<|message|>", "<|call|>"))
# Texts the parsers must see even where they are control tokens (the detokenizer keeps them).
ALL_MARKERS = frozenset(m for f in (*FORMATS.values(), *XML_FORMATS.values(), GEMMA4)
                        for m in f.markers)


def detect(template: str | None, reads_tools: bool) -> ToolFormat:
    """The family format a chat template implies (hermes when it ignores `tools`: that is the
    format tool_prompt.py injects)."""
    source = template or ""
    if not reads_tools:
        return HERMES
    if "<|channel|>" in source:
        return HARMONY
    if "[func_name1(" in source:
        return PYTHONIC
    if "<|tool_call>" in source:
        return GEMMA4
    if "<minimax:tool_call>" in source:
        return MINIMAX
    if _DSML in source and "function_calls" in source:  # DeepSeek V4's block is `tool_calls`
        return DSML
    if "<arg_key>" in source:
        return GLM
    if "<parameter=" in source:
        return QWEN_XML
    if "[TOOL_CALLS]" in source:
        return MISTRAL if "[ARGS]" in source else MISTRAL_LIST
    if "<tool_call>" in source:
        return HERMES
    if "<function=" in source:
        return LLAMA_FUNCTION
    if "<|python_tag|>" in source or "<|start_header_id|>" in source:
        return LLAMA3_JSON
    return JSON
