"""The repository's own rules: the README's commands are the ones CI runs, and the package's layers hold (what imports
what, module sizes, where tests live)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_exactly_the_readme_test_command():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert blocks[0].strip().splitlines() == ["pip install -r requirements.txt", "python app.py"]
    test_command = blocks[1].strip()
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci_lines[-1] == test_command


def test_requirements_pin_the_cpu_torch_available_locally():
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0" and pins["diffusers"] == "0.42.1"
    readme = (ROOT / "README.md").read_text()
    assert f"sdk_version: {pins['gradio']}" in readme and "app_file: app.py" in readme
    assert "MiniMax-Music3 Community License" in readme


# The package's layers, lowest first (DESIGN.md's data flow: request -> prompt -> semantic -> flow -> audio, with the
# app on top). A module may import its own layer's shared modules and anything lower; the stages of one layer
# (semantic and flow; bench and ui) never import each other.
LAYERS = [
    {"__init__", "contract", "errors", "events", "request", "prompt", "audio", "fused_weights", "random_models",
     "checkpoint", "handoff", "versions", "devices", "continuation", "precision", "memory", "memory_plan",
     "weights_stream", "first_audio", "variations"},
    {"semantic", "flow"},
    {"loading", "song_run"},
    {"pipeline"},
    {"bench", "ui"},
    {"cli", "app"},
    {"__main__"},
]
MAX_MODULE_LINES = 450


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
