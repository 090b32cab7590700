"""The course never leans forward: no notebook imports a module that a later notebook exports, and `minfer/` has no
import circle. Every import counts: at the top of a module, inside a function, through `importlib.import_module` and
as a "minfer.x" string (a lazy path). `minfer/__init__.py` is the one exception: its public names load every chapter
so that `from minfer import LLM` sees every registry's entries."""
import ast, json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS, PKG = ROOT / "nbs", ROOT / "minfer"


def chapters():
    "Chapter notebooks in course order (the file names sort in it)."
    return sorted(p for p in NBS.glob("*.ipynb") if p.stem != "index")


def module_chapters():
    "{module name: the notebook that exports it}, read from the header nbdev writes into each module."
    out = {}
    for py in PKG.glob("*.py"):
        m = re.search(r"File to edit: \.\./nbs/(\S+)\.ipynb", py.read_text())
        if m: out[py.stem] = m.group(1)
    return out


def package_names():
    "{name: module} for what `minfer/__init__.py` re-exports (`from minfer import LLM` means `minfer.llm`)."
    tree = ast.parse((PKG / "__init__.py").read_text())
    public, = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "PUBLIC"]
    return ast.literal_eval(public)


def imported_modules(source, package_level=False):
    """minfer modules `source` imports, anywhere in it. package_level: `source` is a module of the package, so
    relative imports (`from .paged import ...`, `from . import paged`) count."""
    names, found = package_names(), set()
    def add(dotted):
        parts = dotted.split(".")
        if parts[0] == "minfer" and len(parts) > 1: found.add(parts[1])
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names: add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level and package_level: base = "minfer." + node.module if node.module else "minfer"
            elif node.level: continue
            else: base = node.module or ""
            if base == "minfer":  # `from minfer import LLM` or `from minfer import paged`
                for a in node.names: add("minfer." + names.get(a.name, a.name))
            else: add(base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"minfer(\.\w+)+", node.value):
            add(node.value)  # "minfer.flash.TritonAttention", import_module("minfer.speculative"), ...
    return found


def notebook_code(nb):
    "A notebook's code cells as Python (IPython's `%magic` and `!shell` lines left out)."
    cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    keep = lambda line: not line.lstrip().startswith(("%", "!"))
    return "\n".join("\n".join(filter(keep, "".join(c["source"]).splitlines())) for c in cells)


def test_every_module_comes_from_a_notebook():
    exported = module_chapters()
    assert set(exported) == {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__", "_modidx"}
    assert set(exported.values()) <= {p.stem for p in chapters()}


def test_no_notebook_imports_a_later_chapter():
    order = {p.stem: i for i, p in enumerate(chapters())}
    exported = module_chapters()
    forward = []
    for nb in chapters():
        for mod in sorted(imported_modules(notebook_code(nb))):
            if mod in exported and order[exported[mod]] > order[nb.stem]:
                forward.append(f"{nb.name} imports minfer.{mod} ({exported[mod]}.ipynb)")
    for mod, nb in exported.items():  # the exported code itself, imports inside functions included
        for other in sorted(imported_modules((PKG / f"{mod}.py").read_text(), package_level=True) - {mod}):
            if other in exported and order[exported[other]] > order[nb]:
                forward.append(f"minfer/{mod}.py ({nb}) imports minfer.{other} ({exported[other]}.ipynb)")
    assert not forward, "the course leans forward:\n" + "\n".join(forward)


def import_graph():
    mods = sorted(module_chapters())
    return {m: sorted(imported_modules((PKG / f"{m}.py").read_text(), package_level=True) & set(mods) - {m})
            for m in mods}


def find_cycle(graph):
    "One import circle of `graph` as [a, b, ..., a], or None (depth-first, colouring nodes)."
    state, stack = {}, []
    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in graph.get(n, []):
            if state.get(m) == "open": return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)): return cycle
        state[n] = "done"
        stack.pop()
        return None
    for n in graph:
        if n not in state and (cycle := visit(n)): return cycle
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checks_can_fail():
    "The detectors themselves, on cases made up here: a relative import inside a function, a lazy path, a circle."
    src = "def f():\n    from .speculative import Speculator\nX = 'minfer.flash.TritonAttention'\nfrom minfer import LLM"
    assert imported_modules(src, package_level=True) == {"speculative", "flash", "llm"}
    assert imported_modules("from .engine import x") == set()  # a notebook has no package: relative imports are not
    assert find_cycle({"engine": ["speculative"], "speculative": ["paged", "engine"], "paged": []}) == \
        ["engine", "speculative", "engine"]
    assert find_cycle({"a": ["b"], "b": ["c"], "c": []}) is None


def test_the_command_line_is_at_the_top_of_the_engine_track():
    "Only the attack chapters (which register subcommands) import `minfer.cli`; the engine never does."
    exported, order = module_chapters(), {p.stem: i for i, p in enumerate(chapters())}
    importers = [m for m, deps in import_graph().items() if "cli" in deps]
    assert all(order[exported[m]] > order[exported["cli"]] for m in importers), importers


def joined_statements(src):
    "Line numbers of `;` statement separators in Python source (a `;` inside a string or a comment is not one)."
    import io, tokenize
    return [t.start[0] for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type == tokenize.OP and t.string == ";"]


def test_one_statement_per_line_in_the_library():
    "No `a; b` in `minfer/`: one statement per line, so a diff, a breakpoint and a coverage line mean one thing."
    found = {py.name: joined_statements(py.read_text()) for py in sorted(PKG.glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, found
    assert joined_statements("x = 1; y = 2\ns = 'a; b'  # c; d\n") == [1]  # the detector sees a real one, only it


def inline_bodies(src):
    "Lines where a compound statement's body starts on its header's line (`if x: return y`, `def f(): return 1`)."
    import ast
    compound = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.FunctionDef,
                ast.AsyncFunctionDef, ast.ClassDef, ast.Try, ast.ExceptHandler)
    return sorted(node.lineno for node in ast.walk(ast.parse(src))
                  if isinstance(node, compound) and node.body and node.body[0].lineno == node.lineno)


def test_block_bodies_on_their_own_lines_in_the_library():
    "No `if x: return y` in `minfer/`: a block's body starts on a line of its own, as `a; b` is two lines."
    found = {py.name: inline_bodies(py.read_text()) for py in sorted(PKG.glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, found
    assert inline_bodies("if x: y = 1\nif z:\n    w = 2\nd = {'a': lambda: 1}\n") == [1]


def test_library_lines_within_120_characters():
    "Lines a reader reads whole; nbdev's own `__all__` line is the one it writes itself."
    found = {py.name: [i for i, line in enumerate(py.read_text().splitlines(), 1)
                       if len(line) > 120 and not line.startswith("__all__")]
             for py in sorted(PKG.glob("*.py")) if py.name != "_modidx.py"}
    assert not {k: v for k, v in found.items() if v}, found


def test_benchmarks_run_every_chapter():
    """A benchmark times the engine a user gets from `from minfer import LLM`, every chapter loaded: one that took
    `LLM` from `minfer.llm` ran without chapter 08a's kernels, and timed AWQ int4 at 1.3 tok/s on the reference path
    (108 with them)."""
    partial = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py"))
               if re.search(r"^\s*from minfer\.llm import .*\bLLM\b", p.read_text(), re.M)]
    assert not partial, f"these benchmarks import LLM from minfer.llm, not from minfer: {partial}"
