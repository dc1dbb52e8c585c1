"""flotilla installs one top-level package, `flotilla` (issue 21): its kernels, libs and services
are `flotilla.kernels`, `flotilla.libs` and `flotilla.services`, so another distribution's
top-level `kernels` (Hugging Face's hub kernels, which transformers imports), `services` or
`libs` can neither shadow flotilla's nor be overwritten by it."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWN = ("kernels", "libs", "services")


def _bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                  if n.split(".")[0] in OWN]
    return found


def test_no_module_imports_flotilla_outside_its_namespace() -> None:
    """`import kernels` would find whichever `kernels` comes first on sys.path, and in a checkout
    it would load flotilla's modules a second time under another name."""
    bad = [hit for folder in (*OWN, "tests", "bench")
           for path in sorted((ROOT / folder).rglob("*.py")) for hit in _bare_imports(path)]
    assert not bad, "\n".join(bad)


def test_the_bare_import_check_sees_every_spelling(tmp_path: Path) -> None:
    probe = ROOT / "tests" / "_namespace_probe.py"
    probe.write_text("import kernels\nimport services.engine\nfrom libs.common import x\n"
                     "from flotilla.kernels import y\nfrom flotilla import services\n")
    try:
        assert [h.split()[-1] for h in _bare_imports(probe)] == [
            "kernels", "services.engine", "libs.common"]
    finally:
        probe.unlink()


def test_a_foreign_top_level_kernels_package_does_not_shadow_flotillas(tmp_path: Path) -> None:
    """Hugging Face's `kernels` installed beside flotilla (first on sys.path here): flotilla's
    engine and its ops still import and run, and the foreign package stays importable."""
    foreign = tmp_path / "kernels"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("FOREIGN = True\n")
    code = ("import torch, kernels\n"
            "from flotilla import kernels as ops\n"
            "from flotilla.services.engine.engine import Engine  # noqa: F401\n"
            "x = torch.randn(3, 8)\n"
            "y = ops.rms_norm(x, torch.ones(8), 1e-6)\n"
            "ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n"
            "assert torch.allclose(y, ref, atol=1e-6), (y, ref)\n"
            "assert kernels.FOREIGN and ops.__name__ == 'flotilla.kernels'\n"
            "print('ok')\n")
    env_path = f"{tmp_path}:{ROOT}"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    """What `pip install flotilla` puts in site-packages: flotilla/ with the three real folders
    (not links), its package data, and nothing else at the top level."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(tmp_path.glob("flotilla-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(top_level).decode().split() == ["flotilla"]
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "flotilla = flotilla.services.launcher.cli:main" in z.read(entry_points).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"flotilla"}
    for module in ("flotilla/kernels/gemv.py", "flotilla/libs/common/settings.py",
                   "flotilla/services/engine/engine.py",
                   "flotilla/services/engine/models/llama.py",
                   "flotilla/services/gateway/ui_static/index.html",
                   "flotilla/services/engine/cpu_native/decode_step.cpp"):
        assert module in names, module
