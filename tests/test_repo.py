"""The repository's own rules: the README's commands are the ones CI runs, the docs describe the present (the README
a short user's page, every module DESIGN.md names exists, no history in the docs or the package), and the package's
layers hold (what imports what, module sizes, where tests live)."""

from __future__ import annotations

import ast
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 170


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_exactly_the_readme_test_command():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert blocks[0].strip().splitlines() == ["pip install -r requirements.txt", "python app.py"]
    test_blocks = [block.strip() for block in blocks if "pytest" in block]
    assert len(test_blocks) == 1, "the README shows one test command"
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci_lines[-1] == test_blocks[0]
    assert test_blocks[0] == "pip install -r requirements-dev.txt && python -m pytest -n 2 --dist loadfile"


def test_requirements_pin_the_cpu_torch_available_locally():
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0" and pins["diffusers"] == "0.42.1"
    readme = (ROOT / "README.md").read_text()
    assert f"sdk_version: {pins['gradio']}" in readme and "app_file: app.py" in readme
    assert "MiniMax-Music3 Community License" in readme


def test_the_readme_is_a_short_users_page():
    """What it is, how to run it, snippets, flags, deploying, licence: the internals live in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md is {len(lines)} lines; move detail into docs/"
    for page in re.findall(r"\]\((docs/[\w./-]+?)(?:#[\w-]+)?\)", "\n".join(lines)):
        assert (ROOT / page).exists(), f"the README links {page}, which does not exist"


# History in words: "issue 25", "issues 14", "run #12", "runs #2", "run 14" (not "run 14 s"); commit ids: 7 to 40 hex
# digits with a letter and a digit, not inside a longer word or number (0x9E37..., 1.75e-38).
HISTORY = re.compile(r"\bissues? #?\d+|(?<!--)\bruns? #\d+|(?<!--)\bruns? \d+[a-z]?\b(?! (?:s|ms|us|µs|GB|frames|songs|"
                     r"steps)\b)", re.I)
COMMIT_ID = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w.-])")
PRESENT_DOCS = ["README.md", "docs/DESIGN.md", "docs/DEVELOPMENT.md", "docs/PERFORMANCE.md", "docs/SPACE.md",
                "docs/VERSIONS.md", "docs/DEPLOY.md"]


def _history(text: str, allow_commit_ids_on: str | None = None) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        hits = HISTORY.findall(line)
        if allow_commit_ids_on is None or not line.startswith(allow_commit_ids_on):
            hits += COMMIT_ID.findall(line)
        found += [f"{number}: {hit!r}" for hit in hits]
    return found


def test_the_history_check_finds_what_it_looks_for():
    assert _history("see issue 25, run #12c and runs #2, #8; run 14 held; the fix is b13f0df") == [
        "1: 'issue 25'", "1: 'run #12'", "1: 'runs #2'", "1: 'run 14'", "1: 'b13f0df'"]
    assert _history("a run 14 s long; --runs 2; 0x9E3779B9, 1.1754943508222875e-38, 2147483647, deadbeef") == []
    assert _history("Provenance: c55ab57\nat c55ab57", allow_commit_ids_on="Provenance:") == ["2: 'c55ab57'"]


def test_the_docs_describe_the_present_without_issue_run_or_commit_references():
    """The archive (docs/runs/) keeps the history; the pages that say how things are now do not narrate it. The
    performance page may name the measured commits on its one provenance line."""
    wrong = []
    for page in PRESENT_DOCS:
        if (ROOT / page).exists():
            allowed = "Provenance:" if page == "docs/PERFORMANCE.md" else None
            wrong += [f"{page}:{hit}" for hit in _history((ROOT / page).read_text(), allowed)]
    assert not wrong, "\n".join(wrong)


def _design_module_paths() -> set[str]:
    """Every file DESIGN.md names: paths in its prose (`music3_demo/x.py`, `semantic/graph.py`, `scripts/x.py`,
    `tests/...`) and the module map's tree (a name indented under its package)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    subpackages = sorted(path.name for path in (ROOT / "music3_demo").iterdir() if (path / "__init__.py").exists())
    named = set()
    for path in re.findall(r"(?<![\w/.])((?:music3_demo|scripts|tests|[a-z_]+)/[\w/]+\.(?:py|sh|json))", text):
        if path.split("/")[0] not in ("music3_demo", "scripts", "tests"):  # relative to the package or a subpackage
            candidates = [f"music3_demo/{path}"] + [f"music3_demo/{sub}/{path}" for sub in subpackages]
            path = next((c for c in candidates if (ROOT / c).exists()), candidates[0])
        named.add(path)
    tree = re.search(r"## Layout.*?```\n(.*?)```", text, flags=re.S).group(1)
    parents: list[str] = []
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        if indent >= 10 or not line.strip():
            continue  # a description's continuation
        names = re.match(r"([^\s,]+(?:, [^\s,]+)*)", line.strip()).group(1)
        parents = parents[: indent // 2]
        for name in names.split(", "):
            if name.endswith("/"):
                parents = parents[: indent // 2] + [name.rstrip("/")]
                named.add("/".join(parents) + "/")
            else:
                named.add("/".join(parents + [name]))
    return named


def test_every_module_design_md_names_exists():
    named = _design_module_paths()
    assert "music3_demo/semantic/select.py" in named and "music3_demo/loading.py" in named and "app.py" in named
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"docs/DESIGN.md names files that do not exist: {missing}"


def _package_text_files() -> list[Path]:
    return [ROOT / "app.py"] + sorted(path for path in (ROOT / "music3_demo").rglob("*")
                                      if path.suffix in (".py", ".json", ".md", ".txt"))


def test_the_package_names_no_issue_run_or_commit():
    """Comments and docstrings state conclusions (with numbers where they matter), never where they came from."""
    wrong = [f"{path.relative_to(ROOT)}:{hit}" for path in _package_text_files() for hit in _history(path.read_text())]
    assert not wrong, "\n".join(wrong)


def test_every_doc_the_package_names_exists():
    wrong = [f"{path.relative_to(ROOT)}: {doc}" for path in _package_text_files()
             for doc in re.findall(r"\bdocs/[\w./-]*\w", path.read_text()) if not (ROOT / doc).exists()]
    assert not wrong, "\n".join(wrong)


# The package's layers, lowest first (DESIGN.md's data flow: request -> prompt -> semantic -> flow -> audio, with the
# app on top). A module may import its own layer's shared modules and anything lower; the stages of one layer
# (semantic and flow; bench and ui) never import each other.
LAYERS = [
    {"__init__", "contract", "errors", "events", "request", "prompt", "audio", "fused_weights", "random_models",
     "checkpoint", "handoff", "versions", "devices", "continuation", "precision", "allocator", "memory", "memory_map",
     "model_figures", "memory_layout", "memory_plan", "stage_swap", "weights_stream", "first_audio", "variations"},
    {"semantic", "flow"},
    {"loading", "song_run"},
    {"pipeline"},
    {"serve"},
    {"bench", "ui"},
    {"cli", "app"},
    {"__main__"},
]
MAX_MODULE_LINES = 430  # about 400: serve/holder.py (427) and semantic/graph.py (408) sit just above


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (and app.py, as `music3_demo.app` would be)."""
    found = {"music3_demo.app": ROOT / "app.py"}
    for path in sorted((ROOT / "music3_demo").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _unit(module: str) -> str:
    """The top-level module or subpackage of music3_demo a dotted name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(unit: str) -> int:
    for index, units in enumerate(LAYERS):
        if unit in units:
            return index
    raise AssertionError(f"music3_demo.{unit} has no layer in LAYERS")


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of music3_demo in the file, lazy ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.startswith("music3_demo")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("music3_demo"):
                found += [(base, alias.name, node.lineno) for alias in node.names]
    return found


def test_every_unit_has_a_layer():
    units = {_unit(name) for name in _modules()}
    assert units <= set().union(*LAYERS), f"give these a layer in LAYERS: {sorted(units - set().union(*LAYERS))}"


def _cross_unit_imports() -> list[tuple[str, str, str, str]]:
    """(where, importing unit, imported unit, what) for every import from one unit of the package into another."""
    found = []
    for name, path in _modules().items():
        unit = _unit(name)
        for module, imported, line in _imports(name, path):
            target = _unit(f"{module}.{imported}" if module == "music3_demo" and imported else module)
            if target != unit:
                found.append((f"{path.relative_to(ROOT)}:{line}", unit, target, f"{module}: {imported}"))
    return found


def test_no_module_imports_a_higher_layer_or_a_sibling_stage():
    wrong = [f"{where} ({unit}) imports {target}" for where, unit, target, _ in _cross_unit_imports()
             if _layer(target) > _layer(unit) or (_layer(target) == _layer(unit) and _layer(unit) > 0)]
    assert not wrong, "\n".join(wrong)


def test_no_module_uses_another_units_private_names():
    def private(what: str) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in what.replace(": ", ".").split("."))

    wrong = [f"{where} ({unit}) imports {what}" for where, unit, _, what in _cross_unit_imports() if private(what)]
    assert not wrong, "\n".join(wrong)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: every import (at module level, under TYPE_CHECKING, inside a
    function). `from X import Y` points at the module X.Y where Y is one, else at X; the parent packages Python loads
    first are no edges (they are loaded before the module runs, whatever it imports)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, imported, _ in _imports(name, path):
            target = f"{module}.{imported}" if imported and f"{module}.{imported}" in modules else module
            if target in modules and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph: each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_the_packages_modules():
    """Control flows one way: no module imports, at any level (TYPE_CHECKING and function-level imports included),
    a module that imports it back."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def _imports_only(statement: ast.stmt) -> bool:
    """An import, or an `if` / `try` of imports (TYPE_CHECKING, an optional package and its fallback value)."""
    if isinstance(statement, (ast.Import, ast.ImportFrom, ast.Pass)):
        return True
    if isinstance(statement, ast.If):
        return all(map(_imports_only, statement.body + statement.orelse))
    if isinstance(statement, ast.Try):
        handlers = [line for handler in statement.handlers for line in handler.body]
        return all(map(_imports_only, statement.body + statement.orelse + statement.finalbody)) and all(
            _imports_only(line) or isinstance(line, ast.Assign) for line in handlers)
    return False


def _late_imports(path: Path) -> list[int]:
    """Lines of the module-level imports that come after other code (a function-level import is no late import)."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    late, code_seen = [], False
    for statement in body:
        if _imports_only(statement):
            if code_seen:
                late.append(statement.lineno)
        else:
            code_seen = True
            late += [node.lineno for node in ast.walk(statement) if isinstance(node, (ast.Import, ast.ImportFrom))
                     and not _inside_a_function(statement, node)]
    return late


def _inside_a_function(statement: ast.stmt, node: ast.AST) -> bool:
    for scope in ast.walk(statement):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and any(
                inner is node for inner in ast.walk(scope)):
            return True
    return False


def test_no_module_imports_after_its_code_starts():
    """The package's modules (app.py, the entry point, turns Gradio's analytics off and imports ZeroGPU's `spaces`
    before anything else may import gradio or touch CUDA)."""
    late = [f"{path.relative_to(ROOT)}:{line}" for name, path in _modules().items() if name != "music3_demo.app"
            for line in _late_imports(path)]
    assert not late, "imports after module code (move them up, or break the cycle that needs them late):\n" + \
        "\n".join(late)


def test_the_cycle_and_late_import_checks_find_what_they_look_for(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    module = tmp_path / "late.py"
    module.write_text('"""Doc."""\nimport os\nif os:\n    import re\nX = 1\nimport sys\n\n\ndef f():\n'
                      '    import json\n\n\nclass C:\n    import abc\n')
    assert _late_imports(module) == [6, 14]


def test_no_module_is_over_the_size_limit():
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines()) for path in _modules().values()}
    assert not {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES}


def test_tests_mirror_the_package_and_gpu_tests_sit_beside_them():
    """CPU and GPU tests of a stage sit together (tests/semantic, tests/flow, tests/ui); GPU-marked tests are in
    test_*_gpu.py files, which is what a GPU run (`pytest -m gpu tests`) collects (tests/conftest.py)."""
    assert not (ROOT / "tests" / "gpu").exists()
    for path in (ROOT / "tests").rglob("test_*.py"):
        marked = any(isinstance(node, ast.Attribute) and node.attr == "gpu" and isinstance(node.value, ast.Attribute)
                     and node.value.attr == "mark" for node in ast.walk(ast.parse(path.read_text())))
        assert marked == path.stem.endswith("_gpu"), f"{path.relative_to(ROOT)}: gpu marker and file name disagree"
    names = [path.name for path in (ROOT / "tests").rglob("*.py") if path.name != "conftest.py"]
    assert len(names) == len(set(names)), "test modules need unique basenames (pytest imports them by name)"


def test_the_files_the_suite_starts_first_exist():
    """tests/conftest.py's LONGEST_FIRST (the suite's wall time on CI's two cores depends on the long files starting
    first): a file renamed or removed is renamed or removed there too."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    (listed,) = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(target, ast.Name) and target.id == "LONGEST_FIRST" for target in node.targets)]
    assert listed and len(set(listed)) == len(listed)
    assert not [path for path in listed if not (ROOT / path).is_file() or not Path(path).name.startswith("test_")]


def _external_imports(path: Path) -> set[str]:
    """Top-level names of the packages outside music3_demo that a file imports (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"music3_demo"}


def test_the_serving_layer_has_no_gradio_in_it():
    """serve/ is what a Ray replica or another front runs: no module of it imports Gradio, directly or through any
    module of the package it imports (ui/ is the only place for the page and the API wiring)."""
    modules = _modules()

    def package_module(module: str, imported: str | None) -> str | None:
        for name in (f"{module}.{imported}" if imported else None, module):
            if name in modules:
                return name
        return None

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += [target for module, imported, _ in _imports(name, modules[name])
                         if (target := package_module(module, imported)) is not None]
        return seen

    serve = [name for name in modules if name.startswith("music3_demo.serve")]
    assert "music3_demo.serve.backend" in serve
    wrong = {f"{name} (through {other})" for name in serve for other in reached(name)
             if "gradio" in _external_imports(modules[other])}
    assert not wrong, "\n".join(sorted(wrong))
