"""Structured outputs in the engine: grammars compiled by xgrammar, one matcher per request, and
the token bitmask the sampler applies to the logits.

Rules:
- One `StructuredOutputs` per engine (`for_engine(engine)`): the model's vocabulary, read with the
  tokenizer service's `Tokenizer.from_path`, as xgrammar `TokenizerInfo`s, their (caching)
  compilers, and a small thread pool that compiles grammars off the event loop and the step loop.
  The spec -> grammar conversion is the tokenizer service's (`services/tokenizer/guided.py`),
  which already validated the spec before admission.
- A `GuidedRequest` is one request's state, held in `SamplingParams.guided`. Its matcher follows
  the request's output tokens lazily: before each mask it accepts the tokens generated since the
  last one, so preemption (recompute keeps the generated tokens) needs nothing extra.
- Under a constraint, special tokens are never allowed except the request's stop tokens (only
  once the grammar is complete) and those the spec names (`special_tokens`, e.g. `[TOOL_CALLS]`).
- Nothing here raises into the step: a grammar that fails to compile, a token the matcher
  rejects, or a mask that allows nothing leaves the request free only to stop (its stop tokens);
  the error is logged. The engine never crashes on a grammar.
- `GuidedBatch` is the step's part: built on the host with the sampling batch (one bitmask row
  per sampling row), applied on the logits' device (xgrammar's CPU or CUDA kernel).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from libs.common.messages import GuidedDecoding
from libs.common.model_cache import resolve_model
from services.tokenizer import Tokenizer
from services.tokenizer.guided import grammar_of, xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr

    from services.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 30.0  # a step waits at most this long for a request's grammar
_WORKERS = 2


class StructuredOutputs:
    """Compiles guided-decoding specs against one model's vocabulary (see module rules)."""

    def __init__(self, model: str, vocab_size: int, eos_token_ids: Sequence[int] = ()):
        self.model, self.vocab_size = model, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizer: Tokenizer | None = None
        self._compilers: dict[frozenset[str], xgr.GrammarCompiler] = {}

    def request(self, spec: GuidedDecoding, stop_token_ids: Sequence[int],
                ignore_eos: bool = False) -> GuidedRequest:
        """A request's state; its grammar compiles in the background from now on."""
        stops = list(dict.fromkeys([*stop_token_ids, *([] if ignore_eos else self.eos_token_ids)]))
        return GuidedRequest(self._pool.submit(self.compile, spec), stops)

    def compile(self, spec: GuidedDecoding) -> xgr.CompiledGrammar:
        return self._compiler(frozenset(spec.special_tokens)).compile_grammar(grammar_of(spec))

    def _compiler(self, allowed_specials: frozenset[str]) -> xgr.GrammarCompiler:
        with self._lock:
            if allowed_specials not in self._compilers:
                if self._tokenizer is None:
                    self._tokenizer = Tokenizer.from_path(resolve_model(self.model))
                info = tokenizer_info(self._tokenizer, self.vocab_size, allowed_specials)
                self._compilers[allowed_specials] = xgrammar().GrammarCompiler(info,
                                                                               max_threads=1)
            return self._compilers[allowed_specials]


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int,
                   allowed_specials: frozenset[str] = frozenset()) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: each id's exact bytes; special tokens (other than the
    allowed ones) get no bytes, which xgrammar treats as never matching any grammar."""
    vocab = [b"" if i in tokenizer.special_ids and tokenizer.text_of(i) not in allowed_specials
             else raw for i, raw in enumerate(tokenizer.token_bytes[:vocab_size])]
    return xgrammar().TokenizerInfo(vocab, xgrammar().VocabType.RAW, vocab_size=vocab_size)


_by_engine: weakref.WeakKeyDictionary[Any, StructuredOutputs] = weakref.WeakKeyDictionary()


def for_engine(engine: Any) -> StructuredOutputs:
    """The engine's StructuredOutputs (`engine.config.model`, `.vocab_size`, `.eos_token_ids`)."""
    if engine not in _by_engine:
        _by_engine[engine] = StructuredOutputs(engine.config.model, engine.vocab_size,
                                               sorted(getattr(engine, "eos_token_ids", ())))
    return _by_engine[engine]


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    bit = 1 << (token_id % 32)
    bitmask[row, token_id // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit


class GuidedRequest:
    """One request's matcher, fed its output tokens lazily (see module rules). Used only from
    the engine's step thread."""

    def __init__(self, compiled: Future[xgr.CompiledGrammar], stop_token_ids: list[int]):
        self._compiled = compiled
        self.stop_token_ids = stop_token_ids
        self._matcher: xgr.GrammarMatcher | None = None
        self._accepted = 0
        self.failed: str | None = None

    def _fail(self, why: str) -> None:
        if self.failed is None:
            log.error("structured output disabled for a request, it may only stop now: %s", why)
            self.failed = why

    def _ready(self) -> xgr.GrammarMatcher | None:
        if self._matcher is None and self.failed is None:
            try:
                compiled = self._compiled.result(timeout=COMPILE_TIMEOUT_S)
                self._matcher = xgrammar().GrammarMatcher(
                    compiled, override_stop_tokens=self.stop_token_ids or None)
            except Exception as exc:  # noqa: BLE001 - a grammar must never take the engine down
                self._fail(f"the grammar did not compile: {exc}")
        return self._matcher

    def fill(self, bitmask: torch.Tensor, row: int, output_ids: Sequence[int]) -> None:
        """Write the allowed next tokens into `bitmask[row]`, after accepting `output_ids` (all
        the request's generated tokens so far) up to where the matcher already is."""
        matcher = self._ready()
        if matcher is not None:
            for token in output_ids[self._accepted:]:
                if not matcher.accept_token(token):
                    self._fail(f"the matcher rejected token {token}")
                    break
                self._accepted += 1
        if self.failed is None and matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, row)
            if bool(bitmask[row].any()):
                return
            self._fail("the grammar allows no token here")
        if self.stop_token_ids:
            bitmask[row].zero_()
            for token in self.stop_token_ids:
                if token < bitmask.shape[1] * 32:
                    _set_bit(bitmask, row, token)


@dataclass
class GuidedBatch:
    """The constrained rows of one sampling step and their bitmask (int32 [B, ceil(V/32)])."""

    rows: list[int]
    bitmask: torch.Tensor

    @classmethod
    def build(cls, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
              prompt_lens: Sequence[int], vocab_size: int) -> GuidedBatch | None:
        rows = [i for i, p in enumerate(params) if p.guided is not None]
        if not rows:
            return None
        bitmask = xgrammar().allocate_token_bitmask(len(params), vocab_size)
        for i in rows:
            guided = params[i].guided
            assert guided is not None
            guided.fill(bitmask, i, token_ids[i][prompt_lens[i]:])
        return cls(rows, bitmask)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of logits [B, V] with the disallowed tokens of constrained rows at -inf."""
        out = logits.clone()
        xgrammar().apply_token_bitmask_inplace(
            out, self.bitmask.to(out.device, non_blocking=True), indices=self.rows)
        return out
