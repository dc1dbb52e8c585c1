"""Chat templates rendered in a sandbox, under a time budget.

Templates are Jinja, as in Hugging Face `apply_chat_template`: same environment flags
(trim_blocks, lstrip_blocks, loop controls, `{% generation %}`), same helpers (`raise_exception`,
`tojson`, `strftime_now`) and variables (`messages`, `tools`, `add_generation_prompt`,
`bos_token`, `eos_token`, ...). A template comes from the model or from `--chat-template`, so it
is untrusted:

- `ImmutableSandboxedEnvironment`: no dunder access, no mutation of lists/dicts.
- Time budget: `render` runs the template in the calling thread (callers use a worker thread) with
  a trace function that raises `_Timeout` once the deadline passes, on every line the compiled
  template executes, so even a call-free `{% for %}` loop stops. The sandbox's `call` checks too.
  The budget starts when `render` starts: time spent waiting for a thread is not charged to it.
  An overrun is a `TemplateTimeout`.
- Size: results above `max_chars`, and `*`/`%`/padding filters asked for more, are refused.
Every failure is a `ChatTemplateError` with a message fit for the API client.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections.abc import Generator, Iterator
from datetime import datetime
from typing import Any, cast

import jinja2
import jinja2.filters
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.meta import find_undeclared_variables
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILENAME = "<template>"
MAX_CHARS = 4_000_000
_MAX_INT_ARG = 100_000
_BIG_WIDTH = re.compile(r"%[-+ #0]*(\d{6,})|\{[^{}]*:[^{}]*?(\d{6,})")


class ChatTemplateError(Exception):
    """The template could not be rendered for this request (the message says why)."""


class TemplateTimeout(ChatTemplateError):
    """Rendering ran past its time budget (timed from the start of `render`)."""


class _Timeout(BaseException):
    """Raised inside the template's frames; BaseException so no `except Exception` swallows it."""


_local = threading.local()


def _check_deadline() -> None:
    deadline = getattr(_local, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _Timeout


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _guard_size(n: Any, what: str) -> None:
    if isinstance(n, int) and n > _MAX_INT_ARG:
        raise jinja2.exceptions.SecurityError(f"{what} of {n} exceeds the template limit")


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_deadline()
        if isinstance(getattr(__obj, "__self__", None), str | list | tuple):
            for value in (*args, *kwargs.values()):
                _guard_size(value, "an argument")
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    _guard_size(len(seq) * n, "a repetition")
        if operator == "%" and isinstance(left, str) and _BIG_WIDTH.search(left):
            raise jinja2.exceptions.SecurityError("format width exceeds the template limit")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _guarded_filter(env: jinja2.Environment, name: str) -> None:
    """Wrap a padding filter so its width (first argument or `width=`) is bounded."""
    inner = env.filters[name]

    @functools.wraps(inner)
    def guarded(value: Any, *args: Any, **kwargs: Any) -> Any:
        _guard_size(args[0] if args else kwargs.get("width"), f"`{name}` width")
        return inner(value, *args, **kwargs)

    env.filters[name] = guarded


def _guarded_format(value: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(value, str) and _BIG_WIDTH.search(value):
        raise jinja2.exceptions.SecurityError("format width exceeds the template limit")
    return jinja2.filters.do_format(value, *args, **kwargs)


@functools.cache
def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["format"] = _guarded_format
    for name in ("center", "indent", "wordwrap"):
        _guarded_filter(env, name)
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    env = _environment()
    try:
        variables = frozenset(find_undeclared_variables(env.parse(source)))
        return env.from_string(source), variables
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template has a syntax error: {exc}") from exc


def _tracer(frame: Any, event: str, arg: Any) -> Any:
    if frame.f_code.co_filename != TEMPLATE_FILENAME:
        return None
    _check_deadline()
    return _line_tracer


def _line_tracer(frame: Any, event: str, arg: Any) -> Any:
    _check_deadline()
    return _line_tracer


class ChatTemplate:
    """A compiled chat template. `render` is thread-safe and blocking (run it off the loop)."""

    def __init__(self, source: str, timeout_s: float = 2.0, max_chars: int = MAX_CHARS):
        self.source = source
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self._template, self.variables = _compile(source)

    @property
    def uses_tools(self) -> bool:
        return "tools" in self.variables

    def render(self, **context: Any) -> str:
        previous = sys.gettrace()
        _local.deadline = time.monotonic() + self.timeout_s
        sys.settrace(_tracer)
        chunks = cast(Generator[str, None, None], self._template.generate(**context))
        try:
            return self._collect(chunks)
        except _Timeout:
            raise TemplateTimeout(
                f"rendering the chat template took longer than its {self.timeout_s:g}s "
                "budget") from None
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"the chat template did something unsafe: {exc}") from None
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from None
        except (RecursionError, MemoryError, OverflowError) as exc:
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError,
                ZeroDivisionError) as exc:
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            sys.settrace(previous)
            _local.deadline = None
            chunks.close()  # after the deadline is cleared, so closing cannot time out

    def _collect(self, chunks: Iterator[str]) -> str:
        out: list[str] = []
        size = 0
        for chunk in chunks:
            out.append(chunk)
            size += len(chunk)
            if size > self.max_chars:
                raise ChatTemplateError(f"the rendered prompt exceeds {self.max_chars} characters")
            _check_deadline()
        return "".join(out)
