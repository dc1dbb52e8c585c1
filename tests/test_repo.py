"""Repository hygiene that CI enforces: the README's commands, lint and types."""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S)
    assert block, "README has no 'Two commands' block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_two_commands_and_ci_runs_the_test_one() -> None:
    up, test = readme_commands()
    assert "flotilla up" in up
    assert "pytest" in test
    assert test in (ROOT / ".ci" / "run").read_text(), ".ci/run must run the README's test command"


def test_console_script_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'flotilla = "flotilla.services.launcher.cli:main"' in text
    from flotilla.services.launcher.cli import main  # noqa: F401  (importable)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extras")
def test_ruff_clean() -> None:
    r = subprocess.run(["ruff", "check", "libs", "services", "kernels", "tests", "bench",
                        "flotilla"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every read of a FLOTILLA_* variable: os.environ[...], os.environ.get(...),
    os.getenv(...), environ.pop (setting one for a child process, setdefault included, is no
    read)."""
    found = []
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and (
                ast.unparse(node.value).endswith("environ")):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            owner, method = ast.unparse(node.func.value), node.func.attr
            if (owner.endswith("environ") and method in ("get", "pop")) or (
                    method == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Call) and node.args and ast.unparse(node.func) == "getenv":
            key = node.args[0]
        if key is None:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            if key.value.startswith("FLOTILLA_"):
                found.append((node.lineno, key.value))
        else:  # a computed name could be anything: name it in settings instead
            found.append((node.lineno, ast.unparse(key)))
    return found


def test_no_flotilla_variable_is_read_outside_the_settings() -> None:
    """One owner for every setting (STYLE.md rule 7): FLOTILLA_* variables are declared and read
    in libs/common/settings.py only; everything else gets them passed down."""
    allowed = {ROOT / "libs" / "common" / "settings.py"}
    bad = []
    for package in ("libs", "services", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in allowed:
                continue
            for line, name in _environment_reads(ast.parse(path.read_text(), str(path))):
                if name.startswith("FLOTILLA_") or not name.startswith(("'", '"')):
                    bad.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    assert not bad, "\n".join(bad)


def test_the_environment_check_sees_every_spelling() -> None:
    source = ("import os\nfrom os import environ, getenv\n"
              "a = os.environ['FLOTILLA_A']\nb = os.environ.get('FLOTILLA_B', '')\n"
              "c = os.getenv('FLOTILLA_C')\nd = getenv('FLOTILLA_D')\n"
              "e = environ.get('FLOTILLA_E')\nf = os.environ.get('HOME')\n"
              "env = {**os.environ, 'FLOTILLA_PORT': '1'}\nos.environ['FLOTILLA_X'] = '1'\n")
    names = [name for _, name in _environment_reads(ast.parse(source))]
    assert sorted(names) == ["FLOTILLA_A", "FLOTILLA_B", "FLOTILLA_C", "FLOTILLA_D",
                             "FLOTILLA_E"]


def _module_imports() -> dict[str, set[str]]:
    """Each module of libs/, services/ and kernels/ → the project modules it imports when it is
    imported (top-level statements; imports inside functions or `if TYPE_CHECKING:` excluded)."""
    modules = {}
    for package in ("libs", "services", "kernels"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(("flotilla", *path.relative_to(ROOT).with_suffix("").parts))
            modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                deps |= subs & modules.keys()
                if subs - modules.keys() and node.module in modules:
                    deps.add(node.module)
        graph[name] = deps - {name}
    return graph


def test_kernels_import_nothing_from_the_services() -> None:
    """kernels/ is the bottom layer: what it needs from the engine (AttentionMetadata) lives in
    kernels/ itself."""
    upward = {f"{m} imports {d}" for m, deps in _module_imports().items()
              if m.startswith("flotilla.kernels")
              for d in deps if not d.startswith("flotilla.kernels")}
    assert not upward, sorted(upward)


def test_kernel_selection_module_holds_no_mutable_state() -> None:
    """kernels/selection.py is a frozen value type and its defaults: no process-wide selection
    to install (each engine passes its own down, tests/engine/test_kernel_selection.py), no
    `global` statement, and every module-level name is a class, a function, a type or a frozen
    value."""
    import dataclasses
    import types
    import typing

    from flotilla.kernels import selection

    source = Path(selection.__file__).read_text()
    assert not [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Global | ast.Nonlocal)]
    immutable = (types.ModuleType, type, types.FunctionType, types.GenericAlias, str, int, float,
                 bool, tuple, frozenset, type(None), type(typing.Literal), type(typing.Any),
                 type(annotations))
    mutable = []
    for name, value in vars(selection).items():
        if name.startswith("__") or isinstance(value, immutable):
            continue
        if dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen:  # type: ignore[attr-defined]
            continue
        mutable.append(f"{name}: {type(value).__name__}")
    assert not mutable, mutable
    assert not {"install", "current", "using"} & vars(selection).keys()


def test_no_import_cycles() -> None:
    graph = _module_imports()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        seen[module] = 1
        for dep in sorted(graph[module]):
            if seen.get(dep) == 1:
                return [*path[path.index(dep):], dep] if dep in path else [module, dep]
            if dep not in seen and (cycle := visit(dep, [*path, dep])):
                return cycle
        seen[module] = 2
        return None

    for module in sorted(graph):
        if module not in seen and (cycle := visit(module, [module])):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_configuration_doc_and_example_env_are_generated_from_the_settings() -> None:
    """docs/configuration.md and .example.env are what libs/common/settings_doc.py renders
    now; after changing a setting, run `python -m flotilla.libs.common.settings_doc`."""
    from flotilla.libs.common import settings_doc

    stale = "stale: run `python -m flotilla.libs.common.settings_doc`"
    assert settings_doc.DOC.read_text(encoding="utf-8") == settings_doc.render_doc(), stale
    assert settings_doc.EXAMPLE_ENV.read_text(encoding="utf-8") == (
        settings_doc.render_example_env()), stale


def test_every_variable_the_docs_name_is_a_setting() -> None:
    """The README and docs/ name only FLOTILLA_* variables that exist (the test suite's own
    FLOTILLA_TEST_* aside, tests/endpoints.py; docs/benchmarks.md records past runs)."""
    from flotilla.libs.common.settings_doc import SECTIONS, own_fields

    known = {f"FLOTILLA_{name.upper()}" for _, cls, _ in SECTIONS for name in own_fields(cls)}
    named: dict[str, set[str]] = {}
    docs = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks.md"]
    for path in [ROOT / "README.md", *docs]:
        for name, wildcard in re.findall(r"(FLOTILLA_[A-Z0-9_]*[A-Z0-9])(_\*)?",
                                         path.read_text()):
            if wildcard:  # FLOTILLA_NATS_*: a family of settings
                continue
            if not name.startswith("FLOTILLA_TEST_") and name not in known:
                named.setdefault(name, set()).add(path.name)
    assert not named, named


def test_bench_holds_the_maintained_suite_only() -> None:
    """Every script in bench/ is a benchmark of bench/run.py's table, its runner or a helper;
    bench/README.md shows that table as it is."""
    from bench.run import HELPERS, RUNNERS, SUITE, table

    listed = {b.script for b in SUITE.values()} | HELPERS | RUNNERS
    present = {p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh")}
    assert present - listed == set(), "unlisted scripts (add to bench/run.py or delete)"
    assert listed - present == set(), "bench/run.py names scripts that are gone"
    assert table() in (ROOT / "bench" / "README.md").read_text(), "bench/README.md is stale"


def test_error_messages_name_only_real_flags() -> None:
    """A `--flag` an error names (a string under a `raise` in services/ or libs/) is one
    `flotilla` accepts or a service's own command line takes (every setting, kebab-case: the
    services parse them with pydantic-settings); one once named a flag nothing accepted."""
    from flotilla.libs.common.settings import LauncherSettings
    from flotilla.libs.common.settings_doc import SECTIONS, own_fields
    from flotilla.services.launcher.cli import build_parser

    parser = build_parser(LauncherSettings())
    commands = [parser, *(c for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                          for c in a.choices.values())]
    flags = {s for c in commands for a in c._actions for s in a.option_strings}
    flags |= {"--" + n.replace("_", "-") for _, cls, _ in SECTIONS for n in own_fields(cls)}
    named: dict[str, set[str]] = {}
    for package in ("libs", "services"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for raised in ast.walk(ast.parse(path.read_text())):
                if not isinstance(raised, ast.Raise):
                    continue
                for node in ast.walk(raised):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", node.value):
                            if flag not in flags:
                                named.setdefault(flag, set()).add(str(path.relative_to(ROOT)))
    assert not named, named
