"""From a `TextRequest` to what the engine gets: prompt ids and resolved sampling options.

Rules:
- chat: the chat template renders the request (chat_prompt.py); the rendered text is tokenized
  without adding BOS (templates write it);
- completion: a string prompt is tokenized as a bare prompt (BOS if the model wants one); a token
  id prompt is used as is, after a range check; with `suffix`, the prompt and the suffix become
  a fill-in-the-middle prompt (fim.py); `echo` repeats the prompt before the completion;
- size: a prompt over `max_prompt_chars` characters (before or after the template) is a 400;
- context: prompt tokens + max_tokens must fit `max_model_len` (the engines' published context
  length, service.py), else 400 `context_length_exceeded` (the rule of libs/common/context.py,
  checked here early); max_tokens goes to the engine as it came (unset: the engine resolves it
  to the room left in its own context);
- stopping: the engine gets the model's end-of-turn ids as `stop_token_ids` (unless `ignore_eos`);
- constraints: `response_format` and forced tool calls become the engine's `guided` spec
  (guided.py), for which the prompt says whether it leaves the model inside a reasoning block.
Every method may raise `FlotillaError` (400 with `param`; 503 for a template past its time
budget); `prepare_prompt` and `prepare` block (template rendering, grammar checks) and belong in
a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.libs.common.context import ContextLengthExceeded, resolve_max_tokens
from flotilla.libs.common.errors import invalid_request
from flotilla.libs.common.messages import GuidedDecoding, SamplingOptions, TextRequest
from flotilla.services.tokenizer.chat_prompt import ChatRenderer
from flotilla.services.tokenizer.chat_template import MAX_CHARS
from flotilla.services.tokenizer.fim import FimTokens, fim_prompt, fim_tokens
from flotilla.services.tokenizer.guided import guided_spec
from flotilla.services.tokenizer.harmony import FINAL, control_ids
from flotilla.services.tokenizer.reasoning import ReasoningParser
from flotilla.services.tokenizer.tokenizer import Tokenizer
from flotilla.services.tokenizer.tool_formats import ToolFormat


@dataclass
class PreparedPrompt:
    text: str
    token_ids: list[int]
    echo: str = ""
    guided: GuidedDecoding | None = None
    reasoning_end: str | None = None  # the prompt opened a reasoning block this tag closes


class PromptBuilder:
    """Shared by all requests of one tokenizer service; holds no per-request state."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int,
                 template_override: str | None = None, template_timeout_s: float = 2.0,
                 max_prompt_chars: int = MAX_CHARS):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self.chat = ChatRenderer(tokenizer, template_override, template_timeout_s,
                                 max_prompt_chars)
        self.special_texts = frozenset(t for i in tokenizer.special_ids
                                       if (t := tokenizer.text_of(i)))
        self._fim: FimTokens | None = fim_tokens(tokenizer)

    def tool_format(self) -> ToolFormat:
        return self.chat.tool_format()

    def render_chat(self, req: TextRequest) -> str:
        return self.chat.render(req).text

    # ------------------------------------------------------------------ both kinds

    def prepare_prompt(self, req: TextRequest) -> PreparedPrompt:
        """The prompt's text and ids (no grammar: `guided_spec` adds it)."""
        if req.kind == "chat":
            if req.suffix is not None:
                raise invalid_request("suffix applies to completions only", param="suffix",
                                      code="invalid_value")
            rendered = self.chat.render(req)
            parser = ReasoningParser.for_prompt(self.tokenizer, rendered.text)
            end = parser.end if parser is not None and parser.in_reasoning else None
            if control_ids(self.tokenizer):  # gpt-oss: the answer is the final channel's
                end = FINAL
            return PreparedPrompt(
                text=rendered.text, token_ids=self.tokenizer.encode(rendered.text, False),
                echo=rendered.echo, reasoning_end=end)
        prompt = req.prompt
        if isinstance(prompt, str | list) and len(prompt) > self.max_prompt_chars:
            raise invalid_request(f"the prompt is longer than this server's limit of "
                                  f"{self.max_prompt_chars}", param="prompt",
                                  code="invalid_value")
        if isinstance(prompt, list) and not self.tokenizer.valid_ids(prompt):
            last = self.tokenizer.vocab_size - 1
            raise invalid_request(f"prompt holds token ids outside the vocabulary (0..{last})",
                                  param="prompt", code="invalid_value")
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list):
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        else:
            raise invalid_request("a completion request needs a prompt", param="prompt")
        if req.suffix is not None:
            ids = fim_prompt(self.tokenizer, self._fim, text, req.suffix)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
        if not ids:
            raise invalid_request("the prompt is empty", param="prompt", code="invalid_value")
        return PreparedPrompt(text=text, token_ids=ids, echo=text if req.echo else "")

    def guided(self, req: TextRequest, prepared: PreparedPrompt) -> GuidedDecoding | None:
        """The request's constraint (grammar checks: blocking)."""
        return guided_spec(req, self.tool_format(), prepared.reasoning_end, self.special_texts)

    def prepare(self, req: TextRequest) -> PreparedPrompt:
        """Prompt and constraint in one call (blocking; the service runs the two parts in
        separate worker lanes)."""
        prepared = self.prepare_prompt(req)
        prepared.guided = self.guided(req, prepared)
        return prepared

    def check_context(self, req: TextRequest, prompt_tokens: int) -> None:
        """A 400 when the prompt (with max_tokens, if given) does not fit the context."""
        max_tokens = req.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise invalid_request("max_tokens must be at least 1", param="max_tokens",
                                  code="invalid_value")
        try:
            resolve_max_tokens(prompt_tokens, max_tokens, self.max_model_len,
                               "messages" if req.kind == "chat" else "prompt")
        except ContextLengthExceeded as exc:
            raise invalid_request(str(exc), param=exc.param,
                                  code="context_length_exceeded") from None

    def sampling(self, req: TextRequest, prompt_tokens: int,
                 guided: GuidedDecoding | None = None) -> SamplingOptions:
        """The engine's sampling options: the context checked, end-of-turn ids added, the
        request's constraint (`PreparedPrompt.guided`) attached."""
        self.check_context(req, prompt_tokens)
        stop_ids = list(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stop_ids += [i for i in self.tokenizer.end_of_generation_ids() if i not in stop_ids]
        return req.sampling.model_copy(update={
            "stop_token_ids": stop_ids,
            "guided": guided,
        })
