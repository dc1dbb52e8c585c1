"""Qwen3.5 / Qwen3.5-MoE vision-language checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`, the form the Hub publishes) served as their text model:
the hybrid decoder of models/qwen3_next.py under `model.language_model.`, the vision tower
(`model.visual.`) skipped. Image and video inputs are not supported; text-only checkpoints
(`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) load as Qwen3NextForCausalLM directly."""

from __future__ import annotations

from flotilla.services.engine.models.qwen3_next import Qwen3NextForCausalLM
from flotilla.services.engine.models.text_only import TextOnlyMixin


class Qwen3_5ForConditionalGeneration(TextOnlyMixin, Qwen3NextForCausalLM):  # noqa: N801
    pass
