"""The committed build (services/gateway/ui_static/) is the build of the committed sources (ui/).

ui/build.mjs records a sha256 over the sources and one per output file in build.json. Here the
source hash is recomputed independently (same definition: "<path>\\n<size>\\n<bytes>" per file,
relative paths sorted) and each output is hashed; where node and ui/node_modules exist, the UI
is rebuilt into a temp dir and compared byte for byte. Also: the served HTML has no inline
script or style and loads nothing from another origin, and the whole build is small."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from flotilla.services.gateway.ui import STATIC_DIR

ROOT = Path(__file__).resolve().parents[2]
UI = ROOT / "ui"
SOURCES = ["build.mjs", "package.json", "package-lock.json", "tsconfig.json", "src", "public"]


def tree_hash(root: Path, names: list[str]) -> str:
    files = sorted(
        p.relative_to(root).as_posix()
        for name in names
        for p in ([root / name] if (root / name).is_file() else (root / name).rglob("*"))
        if p.is_file())
    digest = hashlib.sha256()
    for rel in files:
        data = (root / rel).read_bytes()
        digest.update(f"{rel}\n{len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


def record() -> dict:
    return json.loads((STATIC_DIR / "build.json").read_text())


def test_build_matches_the_sources() -> None:
    assert record()["sources_sha256"] == tree_hash(UI, SOURCES), (
        "ui/ changed since services/gateway/ui_static was built: run `make -C ui` and commit")


def test_outputs_are_the_recorded_build() -> None:
    outputs = record()["outputs"]
    on_disk = sorted(p.name for p in STATIC_DIR.iterdir() if p.name != "build.json")
    assert sorted(outputs) == on_disk
    for name, sha in outputs.items():
        assert hashlib.sha256((STATIC_DIR / name).read_bytes()).hexdigest() == sha, name


def test_rebuild_is_identical(tmp_path: Path) -> None:
    if shutil.which("node") is None or not (UI / "node_modules" / "esbuild").is_dir():
        pytest.skip("node or ui/node_modules missing (cd ui && npm ci)")
    subprocess.run(["node", str(UI / "build.mjs"), str(tmp_path)], check=True, cwd=UI,
                   capture_output=True, timeout=120)
    for name in record()["outputs"]:
        assert (tmp_path / name).read_bytes() == (STATIC_DIR / name).read_bytes(), name
    assert json.loads((tmp_path / "build.json").read_text()) == record()


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline: list[str] = []
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._open = tag

    def handle_data(self, data: str) -> None:
        if self._open in ("script", "style") and data.strip():
            self.inline.append(data)

    def handle_endtag(self, tag: str) -> None:
        self._open = None


def test_page_has_no_inline_code_and_no_other_origin() -> None:
    parser = _Tags()
    parser.feed((STATIC_DIR / "index.html").read_text())
    assert not parser.inline, "inline <script>/<style> content (the CSP forbids it)"
    for tag, attrs in parser.tags:
        assert not any(name.startswith("on") for name in attrs), (tag, attrs)
        assert "style" not in attrs, (tag, attrs)
        for name in ("src", "href"):
            value = attrs.get(name)
            if value is not None:
                assert "//" not in value and not value.startswith(("/", "data:")), value
    scripts = [a for t, a in parser.tags if t == "script"]
    assert scripts == [{"type": "module", "src": "ui/app.js"}]


def test_built_assets_are_small() -> None:
    total = sum(len(gzip.compress(p.read_bytes())) for p in STATIC_DIR.iterdir())
    assert total < 1_000_000, f"{total} bytes gzipped"
