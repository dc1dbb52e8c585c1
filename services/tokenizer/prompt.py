"""From a `TextRequest` to what the engine gets: prompt ids and resolved sampling options.

Rules:
- chat: messages are normalized (chat_messages.py), the template (the `--chat-template` file,
  else the model's) renders them in the sandbox, tools reach the model either through the
  template's `tools` variable or, if the template ignores it, through the system message
  (tool_prompt.py); a template that does not render tool calls gets earlier calls written into
  the assistant's content in the family's format, and tool results as `<tool_response>` user
  turns; the rendered text is tokenized without adding BOS (templates write it);
- completion: a string prompt is tokenized as a bare prompt (BOS if the model wants one); a token
  id prompt is used as is, after a range check;
- context: prompt tokens + max_tokens must fit `max_model_len`, else 400
  `context_length_exceeded`; an unset max_tokens takes all the room that is left;
- stopping: the engine gets the model's end-of-turn ids as `stop_token_ids` (unless `ignore_eos`);
- constraints: `response_format` and forced tool calls become the engine's `guided` spec
  (guided.py), validated while preparing.
Every method may raise `FlotillaError` (400 with `param`); `prepare` blocks (template rendering,
grammar checks) and belongs in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.common.errors import FlotillaError, invalid_request
from libs.common.messages import GuidedDecoding, SamplingOptions, TextRequest
from services.tokenizer.chat_messages import normalize_messages
from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from services.tokenizer.guided import guided_spec
from services.tokenizer.reasoning import END, ReasoningParser
from services.tokenizer.tokenizer import Tokenizer
from services.tokenizer.tool_formats import ToolFormat, detect
from services.tokenizer.tool_prompt import inject_tools, inline_tool_history, tool_names

TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool}


@dataclass
class PreparedPrompt:
    text: str
    token_ids: list[int]
    echo: str = ""
    guided: GuidedDecoding | None = None


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None,
                         param: str) -> FlotillaError:
    if max_tokens is None:
        detail = (f"However, your {param} resulted in {prompt_tokens} tokens, which leaves no "
                  "room for a completion.")
    else:
        detail = (f"However, you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} "
                  f"in the {param}, {max_tokens} in the completion).")
    return invalid_request(
        f"This model's maximum context length is {max_model_len} tokens. {detail} "
        f"Please reduce the length of the {param} or completion.",
        param=param, code="context_length_exceeded")


class PromptBuilder:
    """Shared by all requests of one tokenizer service; holds no per-request state."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int,
                 template_override: str | None = None, template_timeout_s: float = 2.0):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.template_override = template_override
        self.template_timeout_s = template_timeout_s
        self._tool_format: ToolFormat | None = None

    # ------------------------------------------------------------------ chat

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

    def _template(self, with_tools: bool) -> ChatTemplate:
        source = self.template_override or self.tokenizer.chat_template(with_tools)
        if source is None:
            raise invalid_request(
                "this model has no chat template; use /v1/completions or start the tokenizer "
                "with --chat-template FILE", param="messages", code="no_chat_template")
        try:
            return ChatTemplate(source, timeout_s=self.template_timeout_s)
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), param="messages", code="chat_template_error") from None

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

    def render_chat(self, req: TextRequest) -> str:
        normalized = normalize_messages(req.messages)
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if tools:
            tool_names(tools)  # validates names before the template sees them
        template = self._template(with_tools=bool(tools))
        inject = bool(tools) and not template.uses_tools
        context = {
            **self.tokenizer.special_token_texts,
            **self._template_kwargs(req.chat_template_kwargs),
            "tools": tools if template.uses_tools else None,
            "documents": None,
            "add_generation_prompt": req.add_generation_prompt,
        }
        # Templates that refuse a system turn (Gemma) get the tools in the first user turn.
        for as_system in (True, False) if inject else (True,):
            messages = normalized
            if inject:
                messages = inject_tools(messages, tools or [], req.tool_choice, as_system)
            if "tool_calls" not in template.source:
                messages = inline_tool_history(messages, self.tool_format())
            try:
                return template.render(**context, messages=messages)
            except ChatTemplateError as exc:
                error = exc
        raise invalid_request(str(error), param="messages", code="chat_template_error")

    # ------------------------------------------------------------------ both kinds

    def prepare(self, req: TextRequest) -> PreparedPrompt:
        if req.kind == "chat":
            text = self.render_chat(req)
            parser = ReasoningParser.for_prompt(self.tokenizer, text)
            reasoning_end = END if parser is not None and parser.in_reasoning else None
            return PreparedPrompt(text=text, token_ids=self.tokenizer.encode(text, False),
                                  guided=guided_spec(req, self.tool_format(), reasoning_end))
        prompt = req.prompt
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            prepared = PreparedPrompt(text=prompt, token_ids=ids, echo=prompt if req.echo else "")
        elif isinstance(prompt, list):
            if not self.tokenizer.valid_ids(prompt):
                last = self.tokenizer.vocab_size - 1
                raise invalid_request(
                    f"prompt holds token ids outside the vocabulary (0..{last})",
                    param="prompt", code="invalid_value")
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            prepared = PreparedPrompt(text=text, token_ids=list(prompt),
                                      echo=text if req.echo else "")
        else:
            raise invalid_request("a completion request needs a prompt", param="prompt")
        if not prepared.token_ids:
            raise invalid_request("the prompt is empty", param="prompt", code="invalid_value")
        prepared.guided = guided_spec(req, self.tool_format())
        return prepared

    def sampling(self, req: TextRequest, prompt_tokens: int,
                 guided: GuidedDecoding | None = None) -> SamplingOptions:
        """The engine's sampling options: max_tokens resolved, end-of-turn ids added, the
        request's constraint (`PreparedPrompt.guided`) attached."""
        param = "messages" if req.kind == "chat" else "prompt"
        max_tokens = req.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise invalid_request("max_tokens must be at least 1", param="max_tokens",
                                  code="invalid_value")
        room = self.max_model_len - prompt_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise context_length_error(self.max_model_len, prompt_tokens, max_tokens, param)
        stop_ids = list(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stop_ids += [i for i in self.tokenizer.end_of_generation_ids() if i not in stop_ids]
        return req.sampling.model_copy(update={
            "max_tokens": max_tokens if max_tokens is not None else room,
            "stop_token_ids": stop_ids,
            "guided": guided,
        })
