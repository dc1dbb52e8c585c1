"""llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server) built from the sources
vendored in the llama-cpp-python sdist, for the benchmarks that run llama.cpp beside flotilla
(gpu_vs_llamacpp.py, cpu_server_vs_llamacpp.py).

    python bench/llamacpp_build.py trim [SDIST] [OUT]   # default: build/llamacpp-src.tar.gz
    python bench/llamacpp_build.py build --targets llama-server [--cuda] [--jobs N]

`trim` keeps what the build reads (CMake files, ggml with its CPU and CUDA backends, src,
include, common, tools, vendor, the UI-assets script) and drops the rest (models' vocab files,
docs, tests, examples, other backends): ~8 MB against the sdist's 77 MB, small enough to carry
to a device call. Get the sdist with
`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d build/`.
`build` configures once per build folder (the sources unpacked beside it) and builds only the
named targets; nothing is fetched from the network (prebuilt UI, OpenSSL, NCCL, CCCL off).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRIMMED = ROOT / "build" / "llamacpp-src.tar.gz"
VERSION = "0.3.36"
_PREFIX = "vendor/llama.cpp/"
_DROP_TOP = ("models", "docs", "media", "tests", "examples", "benches", "conversion", "gguf-py",
             "pocs", "skills", "ci", "grammars", "requirements", "app", ".devops", ".github")
_KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda")
_DROP_TOOLS = ("ui/node_modules",)


def _kept(rel: str) -> bool:
    parts = rel.split("/")
    if parts[0] in _DROP_TOP:
        return False
    if rel.startswith("ggml/src/ggml-") and len(parts) > 3 and parts[2] not in _KEEP_BACKENDS:
        return False  # another backend's folder (files such as ggml/src/ggml-alloc.c stay)
    return not any(rel.startswith(f"tools/{d}") for d in _DROP_TOOLS)


def trim(sdist: Path, out: Path = TRIMMED) -> Path:
    """Writes the vendored llama.cpp sources the build needs as out (top folder llama.cpp/)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with tarfile.open(sdist) as src, tarfile.open(tmp, "w:gz", compresslevel=9) as dst:
        for member in src:
            _, _, rel = member.name.partition("/")  # drop llama_cpp_python-X.Y.Z/
            if not rel.startswith(_PREFIX) or not _kept(rel[len(_PREFIX):]):
                continue
            member.name = "llama.cpp/" + rel[len(_PREFIX):]
            member.pax_headers.pop("path", None)  # a long name's PAX record would win on write
            member.pax_headers.pop("linkpath", None)
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    with tarfile.open(tmp) as check:
        stray = [n for n in check.getnames() if n.split("/")[0] != "llama.cpp"]
    if stray:
        raise RuntimeError(f"trim wrote {len(stray)} members outside llama.cpp/: {stray[:3]}")
    tmp.replace(out)
    return out


def cmake_args(cuda: bool) -> list[str]:
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_LLGUIDANCE=OFF"]
    if cuda:  # one architecture, the default (few) flash-attention instances, nothing fetched
        args += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
                 "-DGGML_CUDA_NCCL=OFF", "-DGGML_CUDA_CUB_3DOT2=OFF"]
    else:
        args += ["-DGGML_CUDA=OFF"]
    return args


def build_command(build_dir: Path, targets: list[str], jobs: int) -> list[str]:
    return ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
            "--target", *targets]


def binary(build_dir: Path, target: str) -> Path:
    return build_dir / "obj" / "bin" / target


def start_build(build_dir: Path, targets: list[str], cuda: bool, jobs: int,
                source: Path = TRIMMED, nice: int = 0) -> subprocess.Popen | None:
    """Starts configure + build in the background (log: build_dir/build.log); None when every
    target is already built. The sources (a trimmed tar.gz, the sdist, or a folder) are unpacked
    into build_dir/source once; CMake builds in build_dir/obj."""
    if all(binary(build_dir, t).exists() for t in targets):
        return None
    build_dir.mkdir(parents=True, exist_ok=True)
    src = _sources(source, build_dir / "source")
    obj = build_dir / "obj"
    steps = []
    if not (obj / "CMakeCache.txt").exists():
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        steps.append(["cmake", "-S", str(src), "-B", str(obj), *gen,
                      *cmake_args(cuda)])
    steps.append(build_command(obj, targets, jobs))
    script = " && ".join(" ".join(_quote(a) for a in s) for s in steps)
    log = open(build_dir / "build.log", "ab")  # noqa: SIM115 (the child writes it)
    prefix = ["nice", "-n", str(nice)] if nice else []
    return subprocess.Popen([*prefix, "bash", "-c", script], stdout=log, stderr=subprocess.STDOUT,
                            env=_env(cuda))


def _env(cuda: bool) -> dict[str, str]:
    """The build's environment: nvcc found where CUDA images keep it when it is not on PATH."""
    env = dict(os.environ)
    if cuda and not shutil.which("nvcc") and "CUDACXX" not in env:
        found = sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))
        if found:
            env["CUDACXX"] = str(found[0])
            env["PATH"] = f"{found[0].parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def build(build_dir: Path, targets: list[str], cuda: bool, jobs: int, source: Path = TRIMMED,
          nice: int = 0) -> dict[str, Path]:
    """Builds (if needed) and returns {target: binary}; raises with the log's tail on failure."""
    proc = start_build(build_dir, targets, cuda, jobs, source, nice)
    return finish(proc, build_dir, targets)


def finish(proc: subprocess.Popen | None, build_dir: Path, targets: list[str]) -> dict[str, Path]:
    if proc is not None and proc.wait() != 0:
        tail = (build_dir / "build.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"llama.cpp build failed (rc {proc.returncode}):\n{tail}")
    return {t: binary(build_dir, t) for t in targets}


def _sources(source: Path, dest: Path) -> Path:
    """The llama.cpp source folder: `source` itself, or unpacked from a tarball into dest."""
    if source.is_dir():
        return source
    if (dest / "CMakeLists.txt").exists():
        return dest
    if not source.exists():
        raise FileNotFoundError(
            f"{source}: no llama.cpp sources; run `pip download --no-deps --no-binary :all: "
            f"llama-cpp-python=={VERSION} -d build/` and `python bench/llamacpp_build.py trim`")
    with tarfile.open(source) as tar:
        names = tar.getnames()
        trimmed = names[0].split("/")[0] == "llama.cpp"
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tar.extractall(tmp, filter="data")
    inner = tmp / "llama.cpp" if trimmed else next(tmp.iterdir()) / "vendor" / "llama.cpp"
    shutil.rmtree(dest, ignore_errors=True)
    inner.rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _quote(arg: str) -> str:
    return arg if arg.replace("-", "").replace("=", "").replace("/", "").replace(".", "").replace(
        "_", "").isalnum() else "'" + arg.replace("'", "'\\''") + "'"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trim")
    t.add_argument("sdist", type=Path, nargs="?",
                   default=ROOT / "build" / f"llama_cpp_python-{VERSION}.tar.gz")
    t.add_argument("out", type=Path, nargs="?", default=TRIMMED)
    b = sub.add_parser("build")
    b.add_argument("--targets", default="llama-bench,llama-batched-bench")
    b.add_argument("--cuda", action="store_true")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    b.add_argument("--nice", type=int, default=0)
    b.add_argument("--source", type=Path, default=TRIMMED)
    b.add_argument("--dir", type=Path, help="build folder (default build/llamacpp-cpu|cuda)")
    args = ap.parse_args()
    if args.cmd == "trim":
        out = trim(args.sdist, args.out)
        print(f"{out} ({out.stat().st_size / 1e6:.1f} MB)")
        return
    build_dir = args.dir or ROOT / "build" / ("llamacpp-cuda" if args.cuda else "llamacpp-cpu")
    for name, path in build(build_dir, args.targets.split(","), args.cuda, args.jobs,
                            args.source, args.nice).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
