"""Architecture registry: HF `architectures` name -> model class, imported only when used."""

from __future__ import annotations

import importlib

from services.engine.models.base import CausalLM

# name -> (module, class). Adding an architecture = one line here + one small model file.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("services.engine.models.llama", "LlamaForCausalLM"),
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
