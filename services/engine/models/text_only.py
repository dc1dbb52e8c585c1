"""Serving the language model of a vision-language checkpoint (Mistral 3, Gemma 3 4B+, Llama 4,
Gemma 4, Qwen3.5) as text.

The checkpoint keeps the decoder under `language_model.model.` (the format transformers saves
and the Hub holds) or `model.language_model.` (transformers 5's in-memory naming), the head under
`language_model.lm_head.` or `lm_head.`; the vision tower and projector are skipped. Image inputs
are not supported: prompts are text only.
"""

from __future__ import annotations

from flotilla.services.engine.models.base import CausalLM

_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.", "vision_model.", "model.vision_model.",
           "model.embed_vision.", "model.audio_tower.", "model.embed_audio.", "model.visual.")


class TextOnlyMixin(CausalLM):
    """Put first in the bases: `class XForConditionalGeneration(TextOnlyMixin, XForCausalLM)`."""

    def checkpoint_name(self, name: str) -> str:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        return super().checkpoint_name(name)

    def skip_weight(self, name: str) -> bool:
        return name.startswith(_VISION) or super().skip_weight(name)
