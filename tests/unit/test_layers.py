"""The core and the inspection never import Flask or the Kubernetes client (checked in a fresh interpreter),
and each imports only the packages above it."""

import pkgutil
import subprocess
import sys

import webhook.core
import webhook.inspection

# Every module of the core and of the inspection, read from the packages (a module added later is checked without
# editing this list), and the CLI's parser, which must load without the adapters.
CORE = sorted(f"core.{m.name}" for m in pkgutil.iter_modules(webhook.core.__path__))
INSPECTION = sorted(f"inspection.{m.name}" for m in pkgutil.iter_modules(webhook.inspection.__path__))
PURE = CORE + INSPECTION + ["commands.flags"]
ADAPTERS = ("flask", "kubernetes", "gunicorn", "werkzeug", "urllib3", "ijson", "lmdb", "prometheus_client")
# What a pure package may import of webhook: the core only itself; the inspection the core and itself (it judges
# what webhook.kube read, and never reads).
MAY_IMPORT = {"webhook.core": ("webhook.core",), "webhook.inspection": ("webhook.core", "webhook.inspection")}


def test_the_pure_lists_are_read_from_the_packages():
    assert {"core.settings", "core.rules", "core.admission"} <= set(CORE)
    assert {"inspection.verify", "inspection.audit", "inspection.reports"} <= set(INSPECTION)


def test_the_pure_packages_import_no_adapter_libraries():
    code = (
        "import sys\n"
        + "".join(f"import webhook.{m}\n" for m in PURE)
        + f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {ADAPTERS!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_the_pure_packages_import_only_the_packages_above_them():
    """The core imports itself only; the inspection the core and itself: never kube, serving, commands, at any
    depth of a file (a function's own import too), so an API call cannot creep into a judgement."""
    from pathlib import Path

    root = Path(webhook.__path__[0])
    wrong = []
    for package, allowed in MAY_IMPORT.items():
        for path in sorted((root / package.split(".")[1]).glob("*.py")):
            name = f"{package}.{path.stem}"
            wrong += [f"{name} imports {m}" for m in sorted(_imports(path, name))
                      if not m.startswith(tuple(f"{a}." for a in allowed)) and m not in allowed]
    assert wrong == []


def modules(package) -> list[str]:
    return sorted(f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__))


def test_the_http_serving_stack_does_not_import_the_kubernetes_adapters():
    """Every module of webhook.serving (and webhook.process, which it shares with the keeper) loads without
    webhook.kube or the Kubernetes client: the worker asks the may-I-block rule of webhook.process.blocking, and
    the app is handed the settings it follows and the metrics gate."""
    import webhook.process
    import webhook.serving

    names = modules(webhook.serving) + modules(webhook.process)
    assert {"webhook.serving.app", "webhook.serving.worker", "webhook.process.blocking"} <= set(names)
    code = (
        "import importlib, sys\n"
        f"for m in {names!r}: importlib.import_module(m)\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith(('webhook.kube', 'webhook.commands'))"
        " or m.split('.')[0] == 'kubernetes')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_the_packages_show_the_roles():
    """webhook/ holds packages by role, and beside them only the package's entry points and its Python API."""
    import webhook

    packages = {m.name for m in pkgutil.iter_modules(webhook.__path__) if m.ispkg}
    loose = {m.name for m in pkgutil.iter_modules(webhook.__path__) if not m.ispkg}
    assert packages == {"core", "inspection", "certs", "kube", "serving", "process", "commands"}
    assert loose == {"__main__", "api"}


def test_no_module_over_400_lines_and_no_function_over_60():
    """What the layout promises a reader (issue 36): every module and function of the package fits on a page or two."""
    import ast
    from pathlib import Path

    import webhook

    too_long = []
    for path in sorted(Path(webhook.__path__[0]).rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400:
            too_long.append(f"{path.name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def _imports(path, name: str) -> set[str]:
    """The webhook modules `name` (at `path`) imports, at any depth of the file (TYPE_CHECKING ones too)."""
    import ast

    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("webhook.")}


def test_no_import_circle():
    """No two modules of the package import each other, directly or round a longer path: a circle makes a
    module impossible to read or change alone. (The connections read their worker through
    `webhook.serving.listener.Host`, not the worker's module.)"""
    from pathlib import Path

    import webhook

    root = Path(webhook.__path__[0])
    files = {".".join(("webhook", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {name: _imports(path, name) & set(files) - {name} for name, path in files.items()}

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen

    circled = sorted(m for m in graph if m in reaches(m))
    assert circled == [], circled
