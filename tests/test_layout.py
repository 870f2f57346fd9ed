"""The house rules, checked on the source: an import graph without cycles, NOTEs that can be found and stay short,
no internal issue numbers or files outside the repository, one source for the tested range, a README that links
only to what exists, a code map that names every module, modules of at most 500 lines."""

from __future__ import annotations

import ast
import os
import re
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ddp_patches")
SKIP_DIRS = {".git", ".venv", ".ci-venv", ".lanes", "__pycache__", "build", "dist", "upstream"}
NOTE_DEF = re.compile(r"^\s*# NOTE \[([^\]]+)\]\s*$")
NOTE_REF = re.compile(r"NOTE \[([^\]\n]*)(\]?)")

pytestmark = pytest.mark.docs


def _files(*suffixes: str) -> list[str]:
    found = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        found += [os.path.join(top, n) for n in names if n.endswith(suffixes)]
    return sorted(found)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


# -- the import graph ----------------------------------------------------------------------------------------------
def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def _modules() -> dict[str, str]:
    return {_module_name(p): p for p in _files(".py") if p.startswith(PACKAGE + os.sep)}


def _exports() -> dict[str, str]:
    """The lazy ``ddp_patches.__init__`` map: public name -> submodule it loads on first use."""
    tree = ast.parse(_read(os.path.join(PACKAGE, "__init__.py")))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            return {k.value: f"ddp_patches.{v.elts[0].value}" for k, v in zip(node.value.keys, node.value.values)}
    raise AssertionError("ddp_patches/__init__.py has no _EXPORTS map")


def _imports(name: str, path: str, modules: dict[str, str], exports: dict[str, str]) -> set[str]:
    """Every ddp_patches module ``name`` imports, at module level or inside a function (TYPE_CHECKING aside)."""
    tree = ast.parse(_read(path))
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    found: set[str] = set()

    def add(target: str) -> None:
        if target in modules:
            found.add(target)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:  # a submodule, a name the lazy __init__ loads, or a name defined in base
                if f"{base}.{alias.name}" in modules:
                    add(f"{base}.{alias.name}")
                elif base == "ddp_patches" and alias.name in exports:
                    add(exports[alias.name])
                else:
                    add(base)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            pass  # the lazy __init__: its edges come from _EXPORTS below
    if name == "ddp_patches":
        found |= set(exports.values())
    found.discard(name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_modules():
    """No module reaches itself through imports, including those made inside functions and those made through
    the lazy ``ddp_patches.__init__`` (``import ddp_patches; ddp_patches.apply()`` loads ``ddp_patches.api``)."""
    modules, exports = _modules(), _exports()
    graph = {name: _imports(name, path, modules, exports) for name, path in modules.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_imports_inside_functions():
    """The check itself: an import inside a function and one through the lazy __init__ are edges."""
    modules, exports = _modules(), _exports()
    autoapply = _imports("ddp_patches.autoapply", modules["ddp_patches.autoapply"], modules, exports)
    assert {"ddp_patches", "ddp_patches._registry"} <= autoapply  # both imported inside functions
    assert "ddp_patches.api" in _imports("ddp_patches", modules["ddp_patches"], modules, exports)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# -- NOTEs -------------------------------------------------------------------------------------------------------
def _module_docstring_lines(source: str) -> int:
    tree = ast.parse(source)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    if doc is None or not isinstance(getattr(doc, "value", None), ast.Constant) or not isinstance(doc.value.value, str):
        return 0
    return doc.end_lineno


def _notes() -> tuple[dict[str, list[tuple[str, int, int]]], list[tuple[str, str, int]]]:
    """NOTE definitions (name -> [(file, line, length)]) and references (name, file, line) in the repository."""
    definitions: dict[str, list[tuple[str, int, int]]] = {}
    references: list[tuple[str, str, int]] = []
    for path in _files(".py", ".md"):
        if os.path.abspath(path) == os.path.abspath(__file__):
            continue  # its own messages quote the pattern
        lines = _read(path).splitlines()
        for i, line in enumerate(lines):
            match = NOTE_DEF.match(line)
            if match:
                length = 1
                while i + length < len(lines) and lines[i + length].lstrip().startswith("#") \
                        and not NOTE_DEF.match(lines[i + length]):
                    length += 1
                definitions.setdefault(match.group(1), []).append((_rel(path), i + 1, length))
                continue
            for name, closed in NOTE_REF.findall(line):
                references.append((name if closed else name + " <unclosed>", _rel(path), i + 1))
    return definitions, references


def test_every_note_reference_finds_exactly_one_definition():
    definitions, references = _notes()
    twice = {name: places for name, places in definitions.items() if len(places) > 1}
    assert not twice, f"NOTEs defined more than once: {twice}"
    dangling = [f"{path}:{line}: NOTE [{name}]" for name, path, line in references if name not in definitions]
    assert not dangling, ("references to no NOTE (write the full name on one line):\n  " + "\n  ".join(dangling))


def test_notes_are_short_and_outside_module_docstrings():
    """A NOTE states a rule and names its test (about 15 lines); measurements and history go to the design
    document. It sits beside the code it governs, not in a module docstring."""
    definitions, _ = _notes()
    long = [f"{p}:{line} NOTE [{name}] is {n} lines" for name, places in definitions.items()
            for p, line, n in places if n > 20]
    assert not long, "NOTEs over 20 lines:\n  " + "\n  ".join(long)
    inside = []
    for name, places in definitions.items():
        for path, line, _ in places:
            if path.endswith(".py") and line <= _module_docstring_lines(_read(os.path.join(ROOT, path))):
                inside.append(f"{path}:{line} NOTE [{name}]")
    assert not inside, "NOTEs inside module docstrings:\n  " + "\n  ".join(inside)


TEST_REF = re.compile(r"(tests/[\w/]+\.py)?::(\w+)")  # ``tests/x.py::test_y``; ``::test_z`` is in the same file
GPU_STEP = re.compile(r"the GPU proof's ``([\w-]+)`` step")


def _test_names(path: str) -> set[str]:
    tree = ast.parse(_read(os.path.join(ROOT, path)))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _unproven(block: str) -> list[str]:
    """What is wrong with one NOTE's ``Test:`` line: missing, naming nothing, or naming a file or function that does
    not exist. A rule only a GPU can exercise names its GPU proof step instead (benchmarks/gpu_proof.py)."""
    at = re.search(r"\bTests?:", block)
    if at is None:
        return ["no Test: line"]
    refs, current = [], None
    for file, function in TEST_REF.findall(block[at.start():]):
        current = file or current
        refs.append((current, function))
    steps = GPU_STEP.findall(block[at.start():])
    if not refs and not steps:
        return ["its Test: line names no tests/x.py::test_y"]
    found = []
    for file, function in refs:
        if file is None or not os.path.exists(os.path.join(ROOT, file)):
            found.append(f"{file}::{function}: no such file")
        elif function not in _test_names(file):
            found.append(f"{file}::{function}: no such test")
    proof = _read(os.path.join(ROOT, "benchmarks", "gpu_proof.py"))
    return found + [f"GPU proof step {step!r} does not exist" for step in steps if f"  {step} " not in proof]


def test_every_note_names_a_test_that_exists():
    """Each NOTE's ``Test:`` line names the test proving it, as ``tests/x.py::test_y`` (then ``::test_z`` for more
    in the same file): the file and the function exist. A test renamed or deleted leaves no rule unproven."""
    definitions, _ = _notes()
    missing = []
    for name, places in definitions.items():
        for path, line, length in places:
            block = "\n".join(_read(os.path.join(ROOT, path)).splitlines()[line - 1:line - 1 + length])
            missing += [f"{path}:{line} NOTE [{name}]: {problem}" for problem in _unproven(block)]
    assert not missing, "NOTEs without an existing test:\n  " + "\n  ".join(missing)


def test_the_note_test_check_sees_a_missing_test():
    """The check itself: a renamed test, a wrong file, a shorthand ``::name`` in the same file, no Test: line."""
    here = "tests/test_layout.py"
    assert _unproven(f"# Test: {here}::test_every_note_names_a_test_that_exists, ::test_no_such_test") == \
        [f"{here}::test_no_such_test: no such test"]
    assert _unproven("# Tests: tests/no_such_file.py::test_x") == ["tests/no_such_file.py::test_x: no such file"]
    assert _unproven("# Rule: only words") == ["no Test: line"]
    assert _unproven("# Test: the GPU proof's ``max-seq-cuda`` step (benchmarks/gpu_proof.py)") == []


def test_every_note_names_its_section_and_every_section_lists_its_notes():
    """Each NOTE in the code names the design document's section that explains it (a ``# Design:`` line), and that
    section's ``NOTEs:`` line lists it (``python -m tools.note_sections --check``; ``--write`` fixes the code)."""
    from tools import note_sections

    problems = note_sections.problems()
    assert not problems, "NOTEs and design sections disagree:\n  " + "\n  ".join(problems)


# -- the code map (docs/development.md) ------------------------------------------------------------------------------
CODE_MAP = os.path.join(ROOT, "docs", "development.md")
MAP_PATH = re.compile(r"`(ddp_patches/[\w/.]*)`")
MAX_MODULE_LINES = 500
# Modules over MAX_MODULE_LINES today, by name, until they are split; one no longer over (or gone) must leave the list.
OVER_THE_LIMIT: dict[str, str] = {}  # module -> why it may still be over the limit (none today)


def _code_map() -> list[str]:
    """The paths the code map's table names (between its ``code-map`` markers)."""
    text = _read(CODE_MAP)
    return MAP_PATH.findall(text[text.index("<!-- code-map:start -->"):text.index("<!-- code-map:end -->")])


def _described_modules(text: str | None = None) -> list[str]:
    """The modules a row's description names (`` `x.py` ``, in the package the row gives first): each must exist."""
    text = _read(CODE_MAP) if text is None else text
    table = text[text.index("<!-- code-map:start -->"):text.index("<!-- code-map:end -->")]
    named = []
    for row in table.splitlines():
        cells = row.split(" | ")
        package = re.search(r"`(ddp_patches/[\w/]+?)/?`", cells[1]) if len(cells) > 2 else None
        if package:  # the package / module column only
            named += [f"{package.group(1)}/{name}" for name in re.findall(r"`(\w+\.py)`", cells[1])]
    return named


def _package_entries() -> list[str]:
    """Every module (``ddp_patches/x.py``) and package or folder (``ddp_patches/x/``) under ddp_patches/."""
    found = []
    for top, dirs, names in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        found += [_rel(os.path.join(top, d)) + "/" for d in dirs]
        found += [_rel(os.path.join(top, n)) for n in sorted(names) if n.endswith(".py")]
    return [path.replace(os.sep, "/") for path in found]


def _covered(path: str, names: list[str]) -> bool:
    """``path`` is on the map: itself, or a package above it; a name without ``.py`` or ``/`` is either."""
    return any(path.rstrip("/") == name.rstrip("/") or path == name + ".py" or path.startswith(name.rstrip("/") + "/")
               for name in names)


def _resolves(name: str, root: str = ROOT) -> bool:
    full = os.path.join(root, name)
    return os.path.exists(full) or (not name.endswith((".py", "/")) and os.path.exists(full + ".py"))


def test_every_module_is_on_the_code_map_and_every_path_there_exists():
    """docs/development.md's code map: feature -> package/module -> design section -> tests. A module or package
    added under ddp_patches/ goes on it (itself or its package), and a path on it that was moved or deleted fails."""
    names = _code_map()
    missing = [path for path in _package_entries() if not _covered(path, names)]
    assert not missing, "missing from the code map in docs/development.md:\n  " + "\n  ".join(missing)
    dangling = [name for name in names if not _resolves(name)]
    assert not dangling, "the code map in docs/development.md names what does not exist:\n  " + "\n  ".join(dangling)
    described = _described_modules()
    gone = [path for path in described if not os.path.exists(os.path.join(ROOT, path))]
    assert described and not gone, "the code map describes modules that do not exist:\n  " + "\n  ".join(gone)
    tests = re.findall(r"`(tests/[\w/]+\.py)`", _read(CODE_MAP))
    assert tests and all(os.path.exists(os.path.join(ROOT, t)) for t in tests), [t for t in tests if not _resolves(t)]


def test_no_module_is_over_500_lines_but_the_listed_ones():
    """A module holds one job in at most MAX_MODULE_LINES lines; OVER_THE_LIMIT names today's exceptions, and one
    that has been split or trimmed leaves the list."""
    over = {}
    for path in _files(".py"):
        if path.startswith(PACKAGE + os.sep):
            with open(path, encoding="utf-8") as f:
                lines = sum(1 for _ in f)
            if lines > MAX_MODULE_LINES:
                over[_rel(path).replace(os.sep, "/")] = lines
    unlisted = [f"{path}: {n} lines" for path, n in sorted(over.items()) if path not in OVER_THE_LIMIT]
    assert not unlisted, f"modules over {MAX_MODULE_LINES} lines (split them by job):\n  " + "\n  ".join(unlisted)
    done = [path for path in OVER_THE_LIMIT if path not in over]
    assert not done, "no longer over the limit (or gone): remove from OVER_THE_LIMIT in tests/test_layout.py: " + \
        ", ".join(done)


def _private_imports_across_packages() -> list[str]:
    """``from ddp_patches.<other package> import _name`` in a module of a package under ddp_patches/."""
    found = []
    for name, path in _modules().items():
        parts = name.split(".")
        if len(parts) < 3 and not path.endswith("__init__.py"):
            continue  # a top-level module: not a package's
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        room = package.split(".")[1] if "." in package else None
        tree = ast.parse(_read(path))
        rooms: dict[str, str] = {}  # a local name bound to another room (``from .. import tiled_mlp``)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}".split(".")
                if len(target) >= 2 and target[0] == "ddp_patches" and target[1] != room and \
                        os.path.isdir(os.path.join(PACKAGE, target[1])):
                    rooms[alias.asname or alias.name] = ".".join(target)
            target = base.split(".")
            if len(target) < 2 or target[0] != "ddp_patches" or target[1] == room:
                continue
            if not os.path.isdir(os.path.join(PACKAGE, target[1])):
                continue  # a top-level module (probes, distributed): shared by every room
            found += [f"{_rel(path)}:{node.lineno}: {alias.name} from {base}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
        found += sorted({f"{_rel(path)}:{line}: {chain}" for line, chain in _private_chains(tree, rooms)})
    return found


def _private_chains(tree: ast.AST, rooms: dict[str, str]) -> list[tuple[int, str]]:
    """``tiled_mlp.rules._x``: an attribute chain from a name bound to another room that reaches a private name."""
    chains = []
    for node in ast.walk(tree):
        parts, inner = [], node
        while isinstance(inner, ast.Attribute):
            parts.append(inner.attr)
            inner = inner.value
        if isinstance(inner, ast.Name) and inner.id in rooms and parts:
            private = [i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")]
            if private and private[0] == 0:  # the outermost attribute is the first private one: report it once
                chains.append((node.lineno, ".".join([inner.id, *reversed(parts)])))
    return chains


def test_no_package_imports_another_packages_private_names():
    """A room (rescue/, guard/, engines/, offload/, verify/, ...) uses another room through its public names only."""
    found = _private_imports_across_packages()
    assert not found, "private names imported across packages:\n  " + "\n  ".join(found)
    tree = ast.parse("from .. import tiled_mlp\nx = tiled_mlp.rules._x(1)\ny = tiled_mlp.rules.public\n")
    assert _private_chains(tree, {"tiled_mlp": "ddp_patches.tiled_mlp"}) == [(2, "tiled_mlp.rules._x")]


def test_the_code_map_check_sees_what_is_missing(tmp_path):
    """The check itself: a package covers its modules, a bare name covers a module or a package of that name, a
    name that exists neither way does not resolve."""
    names = ["ddp_patches/rescue/", "ddp_patches/tiled_mlp", "ddp_patches/api.py"]
    assert _covered("ddp_patches/rescue/edges.py", names) and _covered("ddp_patches/rescue/", names)
    assert _covered("ddp_patches/tiled_mlp.py", names) and _covered("ddp_patches/tiled_mlp/shards.py", names)
    assert not _covered("ddp_patches/guard/steps.py", names) and not _covered("ddp_patches/api_helpers.py", names)
    (tmp_path / "ddp_patches" / "room").mkdir(parents=True)
    (tmp_path / "ddp_patches" / "mod.py").write_text("")
    assert _resolves("ddp_patches/room", str(tmp_path)) and _resolves("ddp_patches/mod", str(tmp_path))
    assert not _resolves("ddp_patches/gone.py", str(tmp_path)) and not _resolves("ddp_patches/gone", str(tmp_path))
    row = "<!-- code-map:start -->\n| x | `ddp_patches/rescue/` (`built.py`: y; `gone.py`: z) | §4 | t |\n<!-- code-map:end -->"
    assert _described_modules(row) == ["ddp_patches/rescue/built.py", "ddp_patches/rescue/gone.py"]


def _walk_names_that_do_not_exist() -> list[str]:
    """The names of ddp_patches' own Functions in the graph walk's lists (ddp_patches/rescue/graph.py) that name no
    class defined at that path."""
    tree = ast.parse(_read(os.path.join(PACKAGE, "rescue", "graph.py")))
    listed = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value.startswith("ddp_patches.")]
    missing = []
    for name in listed:
        module, _, cls = name.rpartition(".")
        base = os.path.join(ROOT, *module.split("."))
        path = next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.exists(p)), None)
        defined = path is not None and any(isinstance(n, ast.ClassDef) and n.name == cls
                                           for n in ast.parse(_read(path)).body)
        if not defined:
            missing.append(name)
    return missing


def test_the_graph_walk_names_classes_that_exist():
    """The graph walk knows custom Functions by qualified name (NOTE [Unused parameters marked where DDP marks
    them]): one of the library's own that moved but is listed under its old name would be taken for a Function that
    may run a nested backward, and the rescue would fire late, silently. Rename it in the list when you move it."""
    missing = _walk_names_that_do_not_exist()
    assert not missing, "ddp_patches/rescue/graph.py lists Functions under names that do not exist:\n  " + \
        "\n  ".join(missing)


# -- what the repository cites -------------------------------------------------------------------------------------
INTERNAL = re.compile(r"\b(?:[Ii]ssues? #?\d+\b|[Ii]tems? \d+(?:, \d+)* of issue|round \d+ of|\.\./shared/|shared/"
                      r"(?:FACTS|USER_REPORTS)|FACTS\.md|USER_REPORTS\.md)")


def test_no_internal_issue_numbers_or_files_outside_the_repo():
    """Public upstream references (``pytorch/pytorch#123``) are fine; the project's own tracker and the
    maintainers' notes are not in the repository, so a reader cannot follow them."""
    this = os.path.abspath(__file__)
    found = [f"{_rel(p)}:{i}: {line.strip()[:100]}" for p in _files(".py", ".md", ".toml", ".txt", "run")
             if os.path.abspath(p) != this for i, line in enumerate(_read(p).splitlines(), 1) if INTERNAL.search(line)]
    assert not found, "\n  ".join(["internal references:"] + found)


# -- one source for the tested range -------------------------------------------------------------------------------
def _bound(spec: str, op: str) -> tuple[int, int] | None:
    match = re.search(re.escape(op) + r"(\d+)\.(\d+)", spec)
    return (int(match.group(1)), int(match.group(2))) if match else None


def test_one_source_for_the_tested_range():
    """versions.TESTED_RANGE is the tested range; pyproject's lower bounds are its minimums and torch's upper bound
    is the next minor after the newest tested; the probes and the version errors read it from there."""
    from ddp_patches import probes, versions

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    specs = {re.match(r"[\w-]+", s).group(0): s for s in project["dependencies"] + project["optional-dependencies"]["hf"]}
    for name, (low, high) in versions.TESTED_RANGE.items():
        assert _bound(specs[name], ">=") == low, f"pyproject's {specs[name]!r} vs the tested range {low}..{high}"
    assert _bound(specs["torch"], "<") == (2, versions.TESTED_RANGE["torch"][1][1] + 1), specs["torch"]
    assert probes.TESTED_TORCH is versions.TESTED["torch"]


# -- the README ------------------------------------------------------------------------------------------------------
def test_the_python_floor_and_the_install_line_are_true():
    """pyproject's requires-python is the README's "Python >= X.Y", no lower than what the suite proves (every CI
    lane runs 3.11, and this file imports tomllib, new in 3.11); and no page tells a reader to install the package
    from an index it is not on."""
    import sys

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        floor = _bound(tomllib.load(f)["project"]["requires-python"], ">=")
    readme = _read(os.path.join(ROOT, "README.md"))
    assert floor is not None and floor >= (3, 11) and sys.version_info[:2] >= floor, floor
    assert f"Python >= {floor[0]}.{floor[1]}." in readme
    assert "not on PyPI" in readme
    from_index = re.compile(r'pip install "?ddp_patches\b')
    found = [f"{_rel(p)}:{i}" for p in _files(".md") for i, line in enumerate(_read(p).splitlines(), 1)
             if from_index.search(line)]
    assert not found, "pages that install ddp_patches from an index it is not on: " + ", ".join(found)


def test_readme_is_a_page_a_newcomer_reads():
    lines = _read(os.path.join(ROOT, "README.md")).splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    quick = [i for i, line in enumerate(lines, 1) if line.startswith("#") and "quick start" in line.lower()]
    assert quick and quick[0] <= 60, f"the quick start starts at line {quick[:1]}, not within the first 60"


def test_every_relative_link_resolves():
    """README.md, the design document and docs/: every file a link names exists, every #anchor is a heading."""
    from tools import check_links

    broken = check_links.broken()
    assert not broken, "broken links:\n  " + "\n  ".join(broken)



def test_module_docstrings_say_what_the_module_does_in_a_few_lines():
    """A module docstring names what the module does and its entry points; the rules live in NOTEs beside the code
    and the reasoning in the design document."""
    long = []
    for path in _files(".py"):
        if path.startswith(PACKAGE + os.sep):
            tree = ast.parse(_read(path))
            first = tree.body[0] if tree.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str) and first.end_lineno - first.lineno + 1 > 12:
                long.append(f"{_rel(path)}: {first.end_lineno - first.lineno + 1} lines")
    assert not long, "module docstrings over 12 lines:\n  " + "\n  ".join(long)


def test_note_sections_write_places_the_design_line_and_follows_a_move(tmp_path, monkeypatch):
    """--write on a small tree: the line goes after the ``# Test:`` line (after a list of tests over lines), on the
    last line of a block already at 15 lines; a second run changes nothing; a NOTE moved to another section's list
    gets its line rewritten; a NOTE listed nowhere is reported."""
    from tools import note_sections

    doc = "## 1. One\n\nNOTEs: NOTE [Short], NOTE [Listed tests].\n\n## 2. Two\n\nNOTEs: NOTE [Full].\n"
    full = ["# NOTE [Full]"] + [f"# line {i}" for i in range(13)] + ["# Test: tests/x.py::test_full"]
    code = "\n".join(["# NOTE [Short]", "# Rule: short.", "# Test: tests/x.py::test_short", "x = 1", "",
                      "# NOTE [Listed tests]", "# Rule: two tests.", "# Tests: tests/x.py::test_a and",
                      "# tests/x.py::test_b", "y = 2", "", *full, "z = 3"]) + "\n"
    (tmp_path / note_sections.DOC).write_text(doc)
    (tmp_path / "m.py").write_text(code)
    monkeypatch.setattr(note_sections, "ROOT", str(tmp_path))
    assert len(note_sections.problems()) == 3
    note_sections.write()
    lines = (tmp_path / "m.py").read_text().splitlines()
    ref = f"Design: {note_sections.DOC}"
    assert lines[3] == f"# {ref} §1" and lines[9:11] == ["# tests/x.py::test_b", f"# {ref} §1"]
    assert lines[-2] == f"# Test: tests/x.py::test_full; {ref} §2" and note_sections.problems() == []
    assert note_sections.write() == 0
    (tmp_path / note_sections.DOC).write_text(doc.replace("NOTE [Short], ", "").replace("NOTE [Full].",
                                                                                          "NOTE [Full], NOTE [Short]."))
    note_sections.write()
    assert (tmp_path / "m.py").read_text().splitlines()[3] == f"# {ref} §2" and note_sections.problems() == []
    (tmp_path / note_sections.DOC).write_text(doc.replace("NOTE [Short], ", ""))
    (tmp_path / "m.py").write_text(code)
    assert any("listed in no section" in p for p in note_sections.problems())
