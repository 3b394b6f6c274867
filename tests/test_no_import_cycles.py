"""No import cycle among the modules of `juno_py`, and `juno-py --help` lists every command without importing it.

The graph has an edge A -> B for every `import juno_py...` / `from juno_py... import ...` (absolute or relative)
anywhere in A, inside functions too: a function-level import that closes a circle still ties the two modules
into one, and hides the dependency from whoever reads the top of the file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import juno_py
from juno_py.cli.main import COMMANDS

ROOT = Path(juno_py.__file__).parent


def module_name(path: Path) -> str:
    parts = ("juno_py", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # `import juno_py.a.b` loads juno_py.a.b; a name resolves to its module
                    t = t.rpartition(".")[0]
                if t and t.startswith("juno_py") and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path A -> ... -> A."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for comp in comps:  # a shortest path back to the start, inside the component
        start = min(comp)
        prev, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [start]
        while last is not None and last != start:
            path.insert(1, last)
            last = prev[last]
        found.append(path + [start])
    return found


def test_graph_sees_the_cli_imports():
    graph = import_graph()
    assert "juno_py.cli.common" in graph["juno_py.cli.lora_cmd"]
    assert "juno_py.cli.options" in graph["juno_py.cli.full_cmd"]
    assert "juno_py.errors" in graph["juno_py.cli.common"]


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_cli_modules_import_no_command_module():
    graph = import_graph()
    commands = {m for m in graph if m.startswith("juno_py.cli.") and m.endswith("_cmd")}
    for mod in graph:
        if mod.startswith("juno_py.cli."):
            assert not (graph[mod] & (commands | {"juno_py.cli.main"})), mod


def test_top_level_help_lists_every_command_in_full():
    import importlib

    from click.testing import CliRunner

    from juno_py.cli.main import COMMANDS, cli

    result = CliRunner().invoke(cli, ["--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    for name, (module, attr, description) in COMMANDS.items():
        command = getattr(importlib.import_module(f"juno_py.cli.{module}"), attr)
        assert command.help.strip().split("\n")[0] == description, name
        assert " ".join(description.split()) in " ".join(result.output.split()), name


def test_top_level_help_imports_neither_torch_nor_a_command():
    import subprocess
    import sys

    code = (
        "import sys; sys.argv = ['juno-py', '--help']\nfrom juno_py.cli.main import main\ntry:\n    main()\n"
        "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m == 'torch' or m.endswith('_cmd')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent
    ).stdout
    assert out.strip().splitlines()[-1] == "[]", out


@pytest.mark.parametrize("args", [[], *([name] for name in COMMANDS), ["models", "list"]])
def test_help_and_models_list_do_not_import_torch(args, tmp_path):
    """`juno-py --help`, every `juno-py CMD --help` and `juno-py models list` answer without loading torch (nor
    numpy): the commands import the library only when they run."""
    import os
    import subprocess
    import sys

    argv = [*args, "--help"] if args != ["models", "list"] else args
    code = (
        f"import sys; sys.argv = ['juno-py', *{argv!r}]\nfrom juno_py.cli.main import main\ntry:\n    main()\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    env = {**os.environ, "JUNO_PY_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", (args, r.stdout[-300:])
