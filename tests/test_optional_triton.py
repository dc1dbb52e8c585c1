"""Triton is optional on CPU (kernels/triton_compat.py): a process in which `import triton` fails
builds the engine, generates, and runs the CLI; on CUDA (or with the kernels forced) the engine
refuses to start and names the `gpu` extra.

Each check runs in a child process whose first act is to make triton unimportable the way a
missing package is: `sys.modules["triton"] = None` (then `import triton` raises
ModuleNotFoundError and `importlib.util.find_spec("triton")` is None, as torch checks it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.conftest import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TRITON = textwrap.dedent("""
    import importlib.util, sys
    sys.modules["triton"] = None
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("triton is still importable")
    assert importlib.util.find_spec("triton") is None
""")
PROMPTS = [[5, 9, 17, 33, 2], [100, 101, 7], [42] * 12]
MAX_TOKENS = 8

GENERATE = textwrap.dedent("""
    import json, sys
    import torch
    from flotilla.kernels.triton_compat import HAVE_TRITON
    from flotilla.services.engine.llm import LLM
    from flotilla.services.engine.sampling_params import SamplingParams

    path, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = {"have_triton": HAVE_TRITON,
           "triton_modules": sorted(m for m in sys.modules
                                    if m.split(".")[0] == "triton" and sys.modules[m])}
    for name, quant in (("float", None), ("default", "auto")):
        llm = LLM(path, device="cpu", num_kv_blocks=64, block_size=4, num_threads=1,
                  quantization=quant)
        out[name] = [c.token_ids for c in llm.generate(prompts, params)]
        out[name + "_quantization"] = llm.engine.config.resolved_quantization
    print("RESULT " + json.dumps(out))
""")


def run_child(code: str, *args: str, block: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", (BLOCK_TRITON if block else "") + code, *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_cpu_engine_without_triton_generates_as_with_it(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama"
    hf = save_tiny_llama(path, seed=3, tie_word_embeddings=False)
    args = (str(path), json.dumps(PROMPTS), str(MAX_TOKENS))
    without = result(run_child(GENERATE, *args, block=True))
    with_triton = result(run_child(GENERATE, *args, block=False))

    assert without["have_triton"] is False and without["triton_modules"] == []
    assert with_triton["have_triton"] is True  # the comparison is with the real thing
    # the checkpoint's floats: transformers' greedy tokens, with and without triton
    reference = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert without["float"] == reference
    assert with_triton["float"] == reference
    # the server's CPU default (weight-only quantized layers) takes the same path either way
    assert without["default_quantization"] is not None
    assert without["default_quantization"] == with_triton["default_quantization"]
    assert without["default"] == with_triton["default"]
    assert all(len(t) == MAX_TOKENS for t in without["default"])


REFUSALS = textwrap.dedent("""
    import json, sys
    import torch
    from flotilla import kernels
    from flotilla.kernels import selection
    from flotilla.kernels.triton_compat import TritonMissingError
    from flotilla.services.engine.config import EngineConfig
    from flotilla.services.engine.engine import Engine
    from flotilla.services.engine.quant.base import use_kernels

    path = sys.argv[1]
    out = {}
    for name, kw in (("cuda", {"device": "cuda"}),
                     ("forced", {"device": "cpu", "kernel_selection":
                                 selection.KernelSelection(quant_kernels="triton")})):
        try:
            Engine(EngineConfig(model=path, num_kv_blocks=16, **kw))
            out[name] = None
        except TritonMissingError as exc:
            out[name] = str(exc)
    try:
        kernels.rms_norm_triton(torch.ones(2, 8), torch.ones(8), 1e-5)
        out["launch"] = None
    except TritonMissingError as exc:
        out["launch"] = str(exc)
    out["quant_dispatch"] = use_kernels(torch.device("cpu"), mode="triton")
    print("RESULT " + json.dumps(out))
""")


def test_engine_refuses_triton_work_without_triton(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama"
    save_tiny_llama(path)
    out = result(run_child(REFUSALS, str(path)))
    assert "the engine on cuda" in out["cuda"] and "pip install 'flotilla[gpu]'" in out["cuda"]
    assert "quant_kernels=triton" in out["forced"] and "flotilla[gpu]" in out["forced"]
    assert "flotilla.kernels.rms_norm" in out["launch"] and "flotilla[gpu]" in out["launch"]
    assert out["quant_dispatch"] is False  # forced kernels never dispatch to a missing Triton


CLI_AND_IMPORTS = textwrap.dedent("""
    import importlib, pkgutil, runpy, sys
    sys.argv = ["flotilla", "--help"]
    try:
        runpy.run_module("flotilla.services.launcher.cli", run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    failed = []
    for package in ("flotilla.kernels", "flotilla.libs", "flotilla.services"):
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__,
                                          package + "."):
            if info.name.endswith(".__main__"):  # entry points run when imported
                continue
            try:
                importlib.import_module(info.name)
            except Exception as exc:
                failed.append(f"{info.name}: {exc!r}")
    import flotilla.kernels.triton_compat as compat
    print("HAVE_TRITON", compat.HAVE_TRITON, "flotilla.kernels.gemv" in sys.modules)
    print("FAILED", failed)
""")


def test_cli_and_every_module_import_without_triton() -> None:
    """`flotilla --help`, and every module of the three packages (the kernels' Triton code
    included) imports in a process without triton."""
    proc = run_child(CLI_AND_IMPORTS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "usage: flotilla" in proc.stdout
    assert "HAVE_TRITON False True" in proc.stdout
    assert "FAILED []" in proc.stdout, proc.stdout[-4000:]
