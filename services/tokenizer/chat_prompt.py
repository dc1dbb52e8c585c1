"""A chat request rendered into its prompt text by the model's chat template.

Rules:
- messages are normalized (chat_messages.py), the template (the `--chat-template` file, else the
  model's) renders them in the sandbox; tools reach the model either through the template's
  `tools` variable or, if the template ignores it, through the system message (tool_prompt.py);
  a template that does not render tool calls gets earlier calls written into the assistant's
  content in the family's format, and tool results as `<tool_response>` user turns;
- `reasoning_effort` sets what the template reads for thinking (thinking.py);
  `chat_template_kwargs` (only `enable_thinking`) wins over it;
- `continue_final_message` (vLLM, transformers' semantics): the last message is rendered open, the
  prompt ends where its text ends (a marker appended to the text finds that point), so the model
  continues it; it excludes `add_generation_prompt` (400, as vLLM);
- assistant `reasoning_content` reaches a template that reads `message.thinking` (gpt-oss) as
  `thinking` too; beside tool calls it wins over content (that template takes one of the two:
  the reasoning before a call is what gpt-oss must see again);
- `echo` (vLLM): when the last message is the assistant's, its text opens the reply;
- a template that runs past its time budget is a 503 with Retry-After (the budget is the
  render's own time; a busy process, not the request, is the likely cause); any other template
  failure, or a rendered prompt over `max_chars`, is a 400 naming `messages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flotilla.libs.common.errors import FlotillaError, invalid_request, unavailable
from flotilla.libs.common.messages import TextRequest
from flotilla.services.tokenizer.chat_messages import normalize_messages
from flotilla.services.tokenizer.chat_template import (
    MAX_CHARS,
    ChatTemplate,
    ChatTemplateError,
    TemplateTimeout,
)
from flotilla.services.tokenizer.reasoning import START, ReasoningParser
from flotilla.services.tokenizer.thinking import EMPTY_BLOCK, plan_thinking, with_system_flag
from flotilla.services.tokenizer.tokenizer import Tokenizer
from flotilla.services.tokenizer.tool_formats import ToolFormat, detect
from flotilla.services.tokenizer.tool_prompt import inject_tools, inline_tool_history, tool_names

TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool}
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "
_RETRY_AFTER_S = 1.0


@dataclass
class RenderedChat:
    text: str
    echo: str = ""


def _template_error(exc: ChatTemplateError) -> FlotillaError:
    if isinstance(exc, TemplateTimeout):
        return unavailable(str(exc), retry_after_s=_RETRY_AFTER_S)
    return invalid_request(str(exc), param="messages", code="chat_template_error")


def _as_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant reasoning as `thinking` (see module rules)."""
    out = []
    for msg in messages:
        reasoning = msg.get("reasoning_content")
        if msg["role"] == "assistant" and isinstance(reasoning, str) and reasoning and (
                "thinking" not in msg):
            msg = {**msg, "thinking": reasoning}
            if msg.get("tool_calls"):
                msg["content"] = ""
        out.append(msg)
    return out


class ChatRenderer:
    """Renders chat requests for one model (thread-safe; holds no per-request state)."""

    def __init__(self, tokenizer: Tokenizer, template_override: str | None = None,
                 timeout_s: float = 2.0, max_chars: int = MAX_CHARS):
        self.tokenizer, self.template_override = tokenizer, template_override
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self._tool_format: ToolFormat | None = None
        self._thinks = bool(ReasoningParser.tag_ids(tokenizer))

    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (from the template used for requests with tools)."""
        if self._tool_format is None:
            source = self.template_override or self.tokenizer.chat_template(True)
            try:
                reads_tools = source is not None and ChatTemplate(source).uses_tools
            except ChatTemplateError:
                reads_tools = False
            self._tool_format = detect(source, reads_tools)
        return self._tool_format

    def template(self, with_tools: bool) -> ChatTemplate:
        source = self.template_override or self.tokenizer.chat_template(with_tools)
        if source is None:
            raise invalid_request(
                "this model has no chat template; use /v1/completions or start the tokenizer "
                "with FLOTILLA_CHAT_TEMPLATE=FILE", param="messages", code="no_chat_template")
        try:
            return ChatTemplate(source, timeout_s=self.timeout_s, max_chars=self.max_chars)
        except ChatTemplateError as exc:
            raise _template_error(exc) from None

    @staticmethod
    def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
        out = {}
        for key, value in (kwargs or {}).items():
            if key not in TEMPLATE_KWARGS:
                raise invalid_request(
                    f"chat_template_kwargs.{key} is not supported (allowed: "
                    f"{', '.join(TEMPLATE_KWARGS)})", param=f"chat_template_kwargs.{key}",
                    code="invalid_value")
            if not isinstance(value, TEMPLATE_KWARGS[key]):
                raise invalid_request(
                    f"chat_template_kwargs.{key} must be a {TEMPLATE_KWARGS[key].__name__}",
                    param=f"chat_template_kwargs.{key}", code="invalid_value")
            out[key] = value
        return out

    def render(self, req: TextRequest) -> RenderedChat:
        if req.continue_final_message and req.add_generation_prompt:
            raise invalid_request("continue_final_message and add_generation_prompt cannot both "
                                  "be true", param="continue_final_message", code="invalid_value")
        normalized = normalize_messages(req.messages)
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if tools:
            tool_names(tools)  # validates names before the template sees them
        template = self.template(with_tools=bool(tools))
        if "message.thinking" in template.source:
            normalized = _as_thinking(normalized)
        explicit = self._template_kwargs(req.chat_template_kwargs)
        plan = plan_thinking(req.reasoning_effort, explicit.get("enable_thinking"),
                             template.variables, template.source,
                             self._thinks and "think>" in template.source)
        if plan.system_flag:
            normalized = with_system_flag(normalized, plan.system_flag)
        last = normalized[-1] if normalized else {}
        echo = (last.get("content") or "") if req.echo and last.get("role") == "assistant" else ""
        if req.continue_final_message:
            normalized = self._marked(normalized)
        context = {
            **self.tokenizer.special_token_texts,
            **plan.kwargs,
            **explicit,
            "tools": tools if template.uses_tools else None,
            "documents": None,
            "add_generation_prompt": req.add_generation_prompt,
        }
        text = self._render(template, context, normalized, tools, req)
        if req.continue_final_message:
            text = self._cut_at_mark(text)
        elif plan.close_open_block and text.rstrip().endswith(START):
            text += "\n</think>\n\n"
        elif plan.empty_block and req.add_generation_prompt:
            text += EMPTY_BLOCK
        return RenderedChat(text=text, echo=echo)

    def _render(self, template: ChatTemplate, context: dict[str, Any],
                messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                req: TextRequest) -> str:
        inject = bool(tools) and not template.uses_tools
        error: ChatTemplateError | None = None
        # Templates that refuse a system turn (Gemma) get the tools in the first user turn.
        for as_system in (True, False) if inject else (True,):
            turn = messages
            if inject:
                turn = inject_tools(turn, tools or [], req.tool_choice, as_system)
            if "tool_calls" not in template.source:
                turn = inline_tool_history(turn, self.tool_format())
            try:
                return template.render(**context, messages=turn)
            except TemplateTimeout as exc:
                raise _template_error(exc) from None
            except ChatTemplateError as exc:
                error = exc
        assert error is not None
        raise _template_error(error)

    @staticmethod
    def _marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        last = messages[-1] if messages else {}
        if not isinstance(last.get("content"), str):
            raise invalid_request("continue_final_message needs a final message with text",
                                  param="continue_final_message", code="invalid_value")
        return [*messages[:-1], {**last, "content": last["content"] + _CONTINUE_MARK}]

    @staticmethod
    def _cut_at_mark(text: str) -> str:
        mark = _CONTINUE_MARK.strip()
        if mark not in text:
            raise invalid_request("continue_final_message: the chat template does not write the "
                                  "final message's text, so it cannot be continued",
                                  param="continue_final_message", code="invalid_value")
        at = text.rindex(mark)
        if text[at:at + len(_CONTINUE_MARK)] == _CONTINUE_MARK:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the text's trailing space
