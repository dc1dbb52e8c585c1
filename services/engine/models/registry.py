"""Architecture registry: HF `architectures` name -> model class, imported only when used."""

from __future__ import annotations

import importlib

from flotilla.services.engine.models.base import CausalLM

# name -> (module, class). Adding an architecture = one line here + one small model file.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("flotilla.services.engine.models.llama", "LlamaForCausalLM"),
    # SmolLM3: llama with NoPE layers (ModelConfig.no_rope_layers), nothing else of its own.
    "SmolLM3ForCausalLM": ("flotilla.services.engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("flotilla.services.engine.models.mistral", "MistralForCausalLM"),
    "MinistralForCausalLM": ("flotilla.services.engine.models.mistral", "MistralForCausalLM"),
    "Ministral3ForCausalLM": ("flotilla.services.engine.models.mistral", "Ministral3ForCausalLM"),
    "Mistral3ForConditionalGeneration": ("flotilla.services.engine.models.mistral",
                                         "Mistral3ForConditionalGeneration"),
    "Phi3ForCausalLM": ("flotilla.services.engine.models.phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("flotilla.services.engine.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("flotilla.services.engine.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("flotilla.services.engine.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("flotilla.services.engine.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("flotilla.services.engine.models.gemma3",
                                       "Gemma3ForConditionalGeneration"),
    "Gemma4ForCausalLM": ("flotilla.services.engine.models.gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("flotilla.services.engine.models.gemma4",
                                       "Gemma4ForConditionalGeneration"),
    "StableLmForCausalLM": ("flotilla.services.engine.models.stablelm", "StableLmForCausalLM"),
    "GlmForCausalLM": ("flotilla.services.engine.models.glm4", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("flotilla.services.engine.models.glm4", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("flotilla.services.engine.models.glm4_moe", "Glm4MoeForCausalLM"),
    "GptOssForCausalLM": ("flotilla.services.engine.models.gpt_oss", "GptOssForCausalLM"),
    "Llama4ForCausalLM": ("flotilla.services.engine.models.llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("flotilla.services.engine.models.llama4",
                                       "Llama4ForConditionalGeneration"),
    "MiniMaxM2ForCausalLM": ("flotilla.services.engine.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "MixtralForCausalLM": ("flotilla.services.engine.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("flotilla.services.engine.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("flotilla.services.engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    # Hybrid linear attention (Gated DeltaNet + gated full attention): one model, two layouts.
    "Qwen3NextForCausalLM": ("flotilla.services.engine.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("flotilla.services.engine.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("flotilla.services.engine.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("flotilla.services.engine.models.qwen3_5",
                                        "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("flotilla.services.engine.models.qwen3_5",
                                           "Qwen3_5ForConditionalGeneration"),
    "DeepseekV2ForCausalLM": ("flotilla.services.engine.models.deepseek_v2",
                              "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("flotilla.services.engine.models.deepseek_v3",
                              "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("flotilla.services.engine.models.deepseek_v3",
                               "DeepseekV32ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[CausalLM]:
    try:
        module_name, class_name = _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}") from None
    cls: type[CausalLM] = getattr(importlib.import_module(module_name), class_name)
    return cls
