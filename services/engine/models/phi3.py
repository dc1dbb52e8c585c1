"""Phi-3 / Phi-3.5 / Phi-4-mini: llama whose checkpoints hold fused `qkv_proj` and `gate_up_proj`
tensors (loaded whole by the fused layers, so nothing is packed), with partial rotary and
LongRoPE ("longrope" / legacy "su") from the config and `sliding_window` on every layer."""

from __future__ import annotations

from typing import ClassVar

from flotilla.services.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {}
