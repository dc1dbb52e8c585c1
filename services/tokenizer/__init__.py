"""The tokenizer service: chat templates, tokenization, incremental detokenization, stop strings.

`Tokenizer.from_path` is also the engine library's tokenizer (services/engine/llm.py).
"""

from flotilla.services.tokenizer.tokenizer import Tokenizer, UnsupportedTokenizer

__all__ = ["Tokenizer", "UnsupportedTokenizer"]
