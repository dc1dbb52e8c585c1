"""Shared fixtures: the real SmolLM2 tokenizer, its transformers reference, llama.cpp's golden
vocabularies, and a bus on the loopback NATS server."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from libs.common.bus import Bus
from libs.common.model_cache import cache_dir, ensure_default_model
from services.tokenizer.tokenizer import Tokenizer

NATS_URL = "nats://127.0.0.1:4222"
LLAMA_CPP_SDIST = "llama-cpp-python"
_VOCAB_DIR = "vendor/llama.cpp/models/"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


@pytest.fixture(scope="session")
def hf_reference(smollm2_path: Path):  # type: ignore[no-untyped-def]
    """transformers' own tokenizer for the same GGUF (an independent implementation)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent),
                                                      gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def llama_cpp_vocab() -> Path:
    """llama.cpp's vocab-only GGUFs with golden tokenizations (`.inp` / `.out`), taken from the
    llama-cpp-python source distribution on PyPI once and cached."""
    dest = cache_dir() / "llama-cpp-vocab"
    marker = dest / ".complete"
    if marker.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "-q", "-d", tmp, LLAMA_CPP_SDIST]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            pytest.skip("could not download the llama-cpp-python sdist (golden vocab files)")
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar:
                name = member.name.split("/", 1)[-1]
                if name.startswith(_VOCAB_DIR + "ggml-vocab-") and member.isfile():
                    member.name = Path(name).name
                    tar.extract(member, dest, filter="data")
    marker.touch()
    return dest


@pytest.fixture
async def bus():  # type: ignore[no-untyped-def]
    b = await Bus.connect(NATS_URL, "test-tokenizer")
    yield b
    await b.close()
