"""Structured outputs in the engine: grammars compiled by xgrammar (off every loop, bounded in
time and memory), one matcher per request, and the token bitmask the sampler applies.

Rules:
- One `StructuredOutputs` per engine: the model's vocabulary, read with the tokenizer service's
  `Tokenizer.from_path`, as xgrammar `TokenizerInfo`s and their compilers (one per set of
  allowed special tokens, at most MAX_COMPILERS), and a pool of `compile_workers` threads. The
  spec -> grammar conversion is the tokenizer service's (`services/tokenizer/guided.py`), which
  already validated the spec before admission.
- Compiled grammars are kept in an LRU cache bounded by `cache_max_entries` and
  `cache_max_bytes` (xgrammar's own unbounded cache is off: it grew ~1.3 MiB per distinct
  schema, forever). A spec already compiling is shared, not compiled twice.
- `compile_async` is what admission uses: a cache hit is a finished future; otherwise the
  compile is queued, unless `max_pending` compiles are already queued or running (then a
  RequestError 503 with retry_after_s at once). The caller waits at most its time limit
  (`GrammarCompileTimeout`); the compile itself runs on and lands in the cache, so a retry
  finds it. A spec xgrammar cannot compile raises RequestError 400.
- A `GuidedRequest` is one request's state (a matcher over an already compiled grammar), held
  in `SamplingParams.guided`; the step thread never waits for a compile. Its matcher follows the
  request's output tokens lazily: before each mask it accepts the tokens generated since the
  last one, so preemption (recompute keeps the generated tokens) needs nothing extra.
- Under a constraint, special tokens are never allowed except the request's stop tokens (only
  once the grammar is complete) and those the spec names (`special_tokens`, e.g. `[TOOL_CALLS]`).
- A matcher that rejects a sampled token or allows no token raises RequestError (500) from
  `fill`: the engine fails that request alone (logits_processors.py), never the step.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from flotilla.libs.common.messages import GuidedDecoding
from flotilla.libs.common.model_cache import resolve_model
from flotilla.services.engine.request_error import RequestError
from flotilla.services.tokenizer import Tokenizer
from flotilla.services.tokenizer.guided import grammar_of, xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

MAX_COMPILERS = 4  # distinct special-token sets (tool-call formats): each holds a vocabulary
SpecKey = tuple[str, str | None, tuple[str, ...]]


def spec_key(spec: GuidedDecoding) -> SpecKey:
    return (spec.kind, spec.value, tuple(spec.special_tokens))


class GrammarCompileTimeout(RequestError):
    def __init__(self, seconds: float, retry_after_s: float) -> None:
        super().__init__(f"compiling the request's grammar took longer than {seconds:g} s; it "
                         "goes on in the background, try again shortly", 503,
                         "service_unavailable", "grammar_compile_timeout", retry_after_s)


class StructuredOutputs:
    """Compiles guided-decoding specs against one model's vocabulary (see module rules)."""

    def __init__(self, model: str, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 cache_max_entries: int = 64, cache_max_bytes: int = 128 << 20,
                 compile_workers: int = 2, max_pending: int = 8,
                 compile_timeout_s: float = 5.0):
        self.model, self.vocab_size = model, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_max_entries, self.cache_max_bytes = cache_max_entries, cache_max_bytes
        self.max_pending, self.compile_timeout_s = max_pending, compile_timeout_s
        self._pool = ThreadPoolExecutor(compile_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizer: Tokenizer | None = None
        self._compilers: OrderedDict[frozenset[str], xgr.GrammarCompiler] = OrderedDict()
        self._cache: OrderedDict[SpecKey, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[SpecKey, Future[xgr.CompiledGrammar]] = {}
        self.cache_bytes = 0

    # ------------------------------------------------------------------ compiling

    def compile_async(self, spec: GuidedDecoding) -> Future[xgr.CompiledGrammar]:
        """The spec's compiled grammar, from the cache or from a compile queued now (see module
        rules); raises RequestError 503 when max_pending compiles are under way."""
        key = spec_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done: Future[xgr.CompiledGrammar] = Future()
                done.set_result(hit)
                return done
            if key in self._pending:
                return self._pending[key]
            if len(self._pending) >= self.max_pending:
                raise RequestError(
                    f"{len(self._pending)} grammars are compiling; try again shortly", 503,
                    "service_unavailable", "grammar_compiler_busy",
                    retry_after_s=self.compile_timeout_s)
            future = self._pool.submit(self._compile, spec, key)
            self._pending[key] = future
            return future

    def compile(self, spec: GuidedDecoding, timeout_s: float | None = None
                ) -> xgr.CompiledGrammar:
        """compile_async, waited for here (up to timeout_s, default compile_timeout_s)."""
        future = self.compile_async(spec)
        timeout = self.compile_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            raise GrammarCompileTimeout(timeout, timeout) from None

    def _compile(self, spec: GuidedDecoding, key: SpecKey) -> xgr.CompiledGrammar:
        try:
            compiled = self._compiler(frozenset(spec.special_tokens)).compile_grammar(
                grammar_of(spec))
        except Exception as exc:
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RequestError(f"the request's grammar ({spec.kind}) cannot be compiled: "
                               f"{detail}", 400, "invalid_request_error",
                               "invalid_grammar") from exc
        finally:
            with self._lock:
                self._pending.pop(key, None)
        self._remember(key, compiled)
        return compiled

    def _remember(self, key: SpecKey, compiled: xgr.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self.cache_bytes += size
            while self._cache and (len(self._cache) > self.cache_max_entries
                                   or self.cache_bytes > self.cache_max_bytes):
                _, old = self._cache.popitem(last=False)
                self.cache_bytes -= old.memory_size_bytes

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    def _compiler(self, allowed_specials: frozenset[str]) -> xgr.GrammarCompiler:
        with self._lock:
            if allowed_specials in self._compilers:
                self._compilers.move_to_end(allowed_specials)
                return self._compilers[allowed_specials]
            if self._tokenizer is None:
                self._tokenizer = Tokenizer.from_path(resolve_model(self.model))
            info = tokenizer_info(self._tokenizer, self.vocab_size, allowed_specials)
            compiler = xgrammar().GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self._compilers[allowed_specials] = compiler
            if len(self._compilers) > MAX_COMPILERS:
                self._compilers.popitem(last=False)
            return compiler

    # ------------------------------------------------------------------ requests

    def guided(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int],
               ignore_eos: bool = False) -> GuidedRequest:
        """A request's state over its compiled grammar."""
        stops = list(dict.fromkeys([*stop_token_ids, *([] if ignore_eos else self.eos_token_ids)]))
        return GuidedRequest(compiled, stops)

    def request(self, spec: GuidedDecoding, stop_token_ids: Sequence[int],
                ignore_eos: bool = False) -> GuidedRequest:
        """Compile (waiting here, see `compile`) and return a request's state: the library's
        and the tests' path; a server compiles with compile_async at admission."""
        return self.guided(self.compile(spec), stop_token_ids, ignore_eos)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int,
                   allowed_specials: frozenset[str] = frozenset()) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: each id's exact bytes; special tokens (other than the
    allowed ones) get no bytes, which xgrammar treats as never matching any grammar."""
    vocab = [b"" if i in tokenizer.special_ids and tokenizer.text_of(i) not in allowed_specials
             else raw for i, raw in enumerate(tokenizer.token_bytes[:vocab_size])]
    return xgrammar().TokenizerInfo(vocab, xgrammar().VocabType.RAW, vocab_size=vocab_size)


class GuidedRequest:
    """One request's matcher, fed its output tokens lazily (see module rules). Used only from
    the engine's step thread."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]):
        self.stop_token_ids = stop_token_ids
        self._matcher = xgrammar().GrammarMatcher(
            compiled, override_stop_tokens=stop_token_ids or None)
        self._accepted = 0

    def fill(self, bitmask: torch.Tensor, row: int, output_ids: Sequence[int]) -> None:
        """Write the allowed next tokens into `bitmask[row]`, after accepting `output_ids` (all
        the request's generated tokens so far) up to where the matcher already is. Raises
        RequestError when the matcher rejects a token or allows none."""
        matcher = self._matcher
        for token in output_ids[self._accepted:]:
            if not matcher.accept_token(token):
                raise RequestError(f"structured output: the grammar rejected generated token "
                                   f"{token}", 500, "server_error", "grammar_failed")
            self._accepted += 1
        matcher.fill_next_token_bitmask(bitmask, row)
        if not bool(bitmask[row].any()):
            raise RequestError("structured output: the grammar allows no next token", 500,
                               "server_error", "grammar_failed")
