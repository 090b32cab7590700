"""Workshop mode: student copies of the course notebooks, with every exercise's solution replaced by a stub.

The exercise convention (for every chapter):

    #| exercise
    # hint: one line that nudges without giving the answer      <- optional
    def some_function(arg, other=1):
        "Docstring: kept in the student copy."
        ...the solution...

  - the first line of the code cell is `#| exercise`; an optional second line `# hint: <text>`;
  - the rest of the cell is one or more top-level function definitions (the solution);
  - the *next* code cell is the check: asserts that pass with the solution and fail without it;
  - exercise cells are never `#| export`ed (the library keeps its own version of the idea).

`python tools/workshop.py [--out workshop]` writes one student notebook per `nbs/*.ipynb`: each exercise function keeps
its signature and docstring, and its body becomes `raise NotImplementedError("<hint>")`; the checks stay; every
output is cleared except those of cells flagged `#| slow` or `#| gpu` (measurements too slow, or impossible, to
re-run in class: the stored run is what the student reads). `tests/test_workshop.py` proves each check fails on the
stub and passes with the solution.

No solution above its stub. A student copy must not show, above an exercise, code that already solves it. The rule:
no function defined in a cell above the exercise may have (nearly) the solution's body -- compared as token streams
with the names local to each function renamed in order of appearance, `shown_solutions()` reports any pair whose
similarity (difflib ratio) reaches `SHOWN_RATIO`. Two ways to satisfy it:
  - put the exercise before the code that solves it (the exercise is then the chapter's simplest version, and the
    exported one comes after it), or ask for something the chapter has not shown;
  - or mark the `#| export` cell that holds the solution with a second directive line `#| solution`: in the student
    copy its source becomes an import of the names it defines from the exported module (`from minfer.naive import
    naive_generate`), followed by its other top-level statements (`MLP_KINDS["moe"] = MoE`), so every later cell runs
    the same and the student sees the code only in the library.
`student_notebook` refuses to write a copy that breaks the rule.
"""
from __future__ import annotations

import argparse, ast, json, re, shutil, sys, tokenize
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT / "nbs"
_DIRECTIVE = re.compile(r"^\s*#\|\s*exercise\s*$")
_HINT = re.compile(r"^\s*#\s*hint:\s*(.*?)\s*$")
_EXPORT = re.compile(r"^\s*#\|\s*(export|exporti|exports)\b", re.MULTILINE)
_LAYOUT_TOKENS = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT, tokenize.ENDMARKER}
_SOLUTION = re.compile(r"^\s*#\|\s*solution\s*$", re.MULTILINE)
_KEEP_OUTPUTS = re.compile(r"^\s*#\|\s*(slow|gpu)\s*$", re.MULTILINE)
_DEFAULT_EXP = re.compile(r"^\s*#\|\s*default_exp\s+(\S+)", re.MULTILINE)
SHOWN_RATIO = 0.6     # body similarity from which an earlier function counts as the exercise's solution shown
SHOWN_MIN_TOKENS = 8  # a solution shorter than this (one short expression) is not compared


@dataclass
class Exercise:
    "One exercise: where it is, what the student writes, and the cell that checks it."
    notebook: Path
    cell: int                       # index of the exercise cell in nb.cells
    check: int                      # index of the check cell (the next code cell)
    functions: list[str]
    hint: str | None
    section: str = ""               # the nearest heading above the exercise
    title: str = ""                 # the bold lead of the markdown cell just before, if any ("Exercise · RMSNorm by hand")
    signatures: list[str] = field(default_factory=list)

    @property
    def id(self): return f"{self.notebook.stem}:{'+'.join(self.functions)}"


def is_exercise(cell) -> bool:
    if cell.cell_type != "code": return False
    lines = cell.source.lstrip("\n").splitlines()
    return bool(lines) and bool(_DIRECTIVE.match(lines[0]))


def parse_exercise_cell(source: str):
    "(hint or None, [FunctionDef nodes], parsed tree) of an exercise cell; raises ValueError if it breaks the convention."
    lines = source.lstrip("\n").splitlines()
    hint = None
    if len(lines) > 1 and (m := _HINT.match(lines[1])): hint = m.group(1) or None
    tree = ast.parse(source)
    funcs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not funcs: raise ValueError("an exercise cell must define at least one top-level function")
    others = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if others: raise ValueError(f"an exercise cell holds only function definitions; line {others[0].lineno} is a {type(others[0]).__name__}")
    return hint, funcs, tree


def _headings(md: str): return [l.lstrip("#").strip() for l in md.splitlines() if re.match(r"^#{1,6}\s", l)]


def find_exercises(nb_path: Path, nb=None) -> list[Exercise]:
    "All exercises of one notebook, in order. Raises ValueError naming the notebook and cell if one breaks the convention."
    nb = nb or nbformat.read(nb_path, as_version=4)
    out, section, last_md = [], "", ""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            if hs := _headings(cell.source): section = hs[-1]
            last_md = cell.source
            continue
        if not is_exercise(cell): continue
        where = f"{nb_path.name}, cell {i}"
        if _EXPORT.search(cell.source): raise ValueError(f"{where}: an exercise cell must not be exported")
        try: hint, funcs, _ = parse_exercise_cell(cell.source)
        except (SyntaxError, ValueError) as e: raise ValueError(f"{where}: {e}") from None
        check = next((j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "code"), None)
        if check is None or is_exercise(nb.cells[check]):
            raise ValueError(f"{where}: an exercise must be followed by a code cell that checks it")
        m = ([None] + list(re.finditer(r"(?m)^\s*\*\*(.+?)\*\*", last_md)))[-1]  # the last bold lead: "**Exercise · ...**"
        sigs = [f"{f.name}({ast.unparse(f.args)})" for f in funcs]
        out.append(Exercise(nb_path, i, check, [f.name for f in funcs], hint, section,
                            m.group(1).rstrip(".") if m else "", sigs))
        last_md = ""
    return out


def stub_source(source: str) -> str:
    "The exercise cell with every top-level function body replaced by `raise NotImplementedError(hint)`."
    hint, funcs, _ = parse_exercise_cell(source)
    lines = source.splitlines(keepends=True)
    for f in sorted(funcs, key=lambda f: f.lineno, reverse=True):
        body = f.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body = body[1:]  # keep the docstring
        msg = json.dumps(hint or f"exercise: write {f.name}", ensure_ascii=False)
        stmt = f"raise NotImplementedError({msg})"
        if not body:  # docstring only: add the stub after it
            end = f.body[0].end_lineno
            indent = re.match(r"\s*", lines[f.body[0].lineno - 1]).group(0)
            lines[end - 1:end] = [lines[end - 1].rstrip("\n") + "\n", indent + stmt + "\n"]
            continue
        first, last = body[0], f.end_lineno
        head = lines[first.lineno - 1].encode()
        if head[:first.col_offset].strip():  # body on the same line as the def or docstring: `def f(x): return x`
            tail = lines[last - 1].encode()[f.end_col_offset:].decode() if last == first.lineno else "\n"
            lines[first.lineno - 1:last] = [head[:first.col_offset].decode() + stmt + (tail if tail.strip() else "\n")]
        else:  # drop everything after the docstring (comments too: they tend to give the answer away)
            indent = re.match(r"\s*", lines[first.lineno - 1]).group(0)
            start = f.body[0].end_lineno + 1 if f.body[0] is not first else first.lineno
            lines[start - 1:last] = [indent + stmt + "\n"]
    out = "".join(lines)
    if not source.endswith("\n") and out.endswith("\n"): out = out[:-1]
    return out


def _clear(cell):
    "Clear a cell's outputs, unless it is flagged slow or gpu: then its stored run is what the student reads."
    if cell.cell_type == "code" and not _KEEP_OUTPUTS.search(cell.source):
        cell.outputs, cell.execution_count = [], None
    for k in ("execution", "collapsed", "scrolled"): cell.metadata.pop(k, None)


def is_solution(cell) -> bool:
    "A code cell marked `#| solution` (with `#| export`): the student copy imports it from the library instead."
    return cell.cell_type == "code" and bool(_SOLUTION.search(cell.source))


def library_import_source(source: str, module: str) -> str:
    """What a `#| solution` cell becomes in a student copy: an import from `minfer.<module>` of the names its functions,
    classes and plain assignments define, then its other top-level statements (registrations, methods attached)."""
    code = _python(source)
    names, rest = [], []
    tree = ast.parse(code)
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): names.append(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and all(
                isinstance(t, ast.Name) for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])):
            names += [t.id for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])]
        else: rest.append(ast.get_source_segment(code, stmt))
    imported = f"from minfer.{module} import {', '.join(dict.fromkeys(names))}"
    if len(imported) > 120:  # the course's line length
        import textwrap
        imported = f"from minfer.{module} import (\n" + textwrap.fill(", ".join(dict.fromkeys(names)), 116,
                                                                 initial_indent="    ", subsequent_indent="    ") + ")"
    lines = ["# This cell's code solves an exercise below: this copy runs the library's version. Write yours first!",
             imported]
    return "\n".join(lines + rest)


def _body_tokens(fn) -> list[str]:
    "A function's body (docstring dropped) as tokens, names local to it renamed _v0, _v1... in order of appearance."
    import io
    body = fn.body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]
    if not body: return []
    local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    for n in ast.walk(ast.Module(body, [])):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store): local.add(n.id)
        elif isinstance(n, ast.arg): local.add(n.arg)
    out, renamed, prev = [], {}, None
    for t in tokenize.generate_tokens(io.StringIO("\n".join(ast.unparse(s) for s in body)).readline):
        if t.type in _LAYOUT_TOKENS: continue
        tok = t.string
        if t.type == tokenize.NAME and tok in local and prev != ".": tok = renamed.setdefault(tok, f"_v{len(renamed)}")
        out.append(tok)
        prev = t.string
    return out


def _functions(source: str):
    "Every function (methods and nested ones too) defined in a cell's code."
    try: tree = ast.parse(_python(source))
    except SyntaxError: return []
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def solution_similarity(solution_fn, other_fn) -> float:
    "difflib ratio of the two functions' bodies as token streams, local names renamed (1.0: the same code)."
    import difflib
    a, b = _body_tokens(solution_fn), _body_tokens(other_fn)
    if not a or not b: return 0.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def shown_solutions(cells, exercises, solutions: dict | None = None) -> list[str]:
    """Where a student copy shows an exercise's solution above its stub: one line per (exercise function, earlier
    function) pair whose bodies are at least `SHOWN_RATIO` alike. `cells`: the student copy's cells, in the original
    order (stubs in place of exercises); `solutions`: cell index -> the exercise cell's original source."""
    found = []
    for ex in exercises:
        for sol in _functions(solutions[ex.cell] if solutions else cells[ex.cell].source):
            if len(_body_tokens(sol)) < SHOWN_MIN_TOKENS: continue
            for i in range(ex.cell):
                c = cells[i]
                if c.cell_type != "code" or is_exercise(c): continue
                for f in _functions(c.source):
                    r = solution_similarity(sol, f)
                    if r >= SHOWN_RATIO:
                        found.append(f"{ex.notebook.name}: exercise `{sol.name}` (cell {ex.cell}) is shown above its "
                                     f"stub as `{f.name}` in cell {i} (similarity {r:.2f})")
    return found


def student_notebook(nb_path: Path):
    """(student notebook, exercises): stubs for every exercise, checks kept, `#| solution` cells turned into library
    imports, outputs cleared (but those of slow and gpu cells), nbdev's export cell dropped. Raises ValueError if the
    copy would still show an exercise's solution above its stub."""
    nb = nbformat.read(nb_path, as_version=4)
    exercises = find_exercises(nb_path, nb)
    solutions = {ex.cell: nb.cells[ex.cell].source for ex in exercises}
    for ex in exercises: nb.cells[ex.cell].source = stub_source(nb.cells[ex.cell].source)
    module = next((m.group(1) for c in nb.cells if c.cell_type == "code" and (m := _DEFAULT_EXP.search(c.source))),
                  None)
    for i, cell in enumerate(nb.cells):
        if not is_solution(cell): continue
        if not _EXPORT.search(cell.source) or module is None:
            raise ValueError(f"{nb_path.name}, cell {i}: a `#| solution` cell must be `#| export`ed "
                             "from a `#| default_exp` module")
        cell.source = library_import_source(cell.source, module)
    if shown := shown_solutions(nb.cells, exercises, solutions): raise ValueError("; ".join(shown))
    for cell in nb.cells: _clear(cell)
    # the notebooks end with `nbdev.nbdev_export()`, which would overwrite minfer/ from nbs/: not in a student copy
    nb.cells = [c for c in nb.cells if not (c.cell_type == "code" and "nbdev_export()" in c.source)]
    nb.metadata.pop("widgets", None)
    if exercises:
        names = ", ".join(f"`{n}`" for ex in exercises for n in ex.functions)
        note = nbformat.v4.new_markdown_cell(
            f"**Workshop copy.** Write the exercise functions ({names}): each raises `NotImplementedError` with a hint "
            "until you replace its body. Run the cell after each exercise to check your answer.")
        title = 1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0
        nb.cells.insert(title, note)
    return nb, exercises


_TEST_FLAGS = re.compile(r"^\s*#\|\s*(notest|gpu|slow)\s*$", re.MULTILINE)


def _python(source: str) -> str:
    "Cell source as plain Python (IPython magics and shell escapes turned into calls), for analysis only."
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(source)


class _Order(ast.NodeVisitor):
    "First load and first store position of each name in a cell's top-level scope (bodies of defs are not entered)."
    def __init__(self): self.loads, self.stores = {}, {}
    def _put(self, d, name, pos): d.setdefault(name, pos) if pos >= d.get(name, pos) else d.__setitem__(name, pos)
    def visit_Name(self, n): self._put(self.loads if isinstance(n.ctx, ast.Load) else self.stores, n.id, (n.lineno, n.col_offset))
    def _targets(self, targets, end):
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Name): self._put(self.stores if isinstance(x.ctx, ast.Store) else self.loads, x.id,
                                                      end if isinstance(x.ctx, ast.Store) else (x.lineno, x.col_offset))
    def visit_Assign(self, n): self.visit(n.value); self._targets(n.targets, (n.end_lineno, n.end_col_offset))
    def visit_AnnAssign(self, n):
        if n.value: self.visit(n.value)
        self._targets([n.target], (n.end_lineno, n.end_col_offset))
    def visit_AugAssign(self, n):
        self.visit(n.value)
        if isinstance(n.target, ast.Name): self._put(self.loads, n.target.id, (n.lineno, n.col_offset))
        self._targets([n.target], (n.end_lineno, n.end_col_offset))
    def _header(self, n, *exprs):
        for e in exprs: self.visit(e)
        self._put(self.stores, n.name, (n.lineno, n.col_offset))
    def visit_FunctionDef(self, n):
        a = n.args
        self._header(n, *n.decorator_list, *a.defaults, *[d for d in a.kw_defaults if d])
    visit_AsyncFunctionDef = visit_FunctionDef
    def visit_ClassDef(self, n): self._header(n, *n.decorator_list, *n.bases, *[k.value for k in n.keywords])
    def visit_Lambda(self, n):
        for d in n.args.defaults + [d for d in n.args.kw_defaults if d]: self.visit(d)
    def _comp(self, n): self.visit(n.generators[0].iter)  # the rest runs in the comprehension's own scope
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comp
    def visit_Import(self, n):
        for a in n.names: self._put(self.stores, a.asname or a.name.split(".")[0], (n.lineno, n.col_offset))
    visit_ImportFrom = visit_Import


def names(source: str):
    """(names the cell defines at top level, names it reads from the notebook's namespace, whether it imports).
    A name counts as read if it is loaded before the cell assigns it, or used inside a function, class or
    comprehension of the cell without being defined by the cell."""
    defs, uses, imports, _ = _names(source)
    return defs, uses, imports


def _patched_classes(fn):
    """The classes a top-level function adds itself to with fastcore's `@patch` (its first parameter's annotation:
    `def schedule(self: Scheduler)` -> {'Scheduler'}); empty for any other function."""
    def is_patch(d):
        d = d.func if isinstance(d, ast.Call) else d
        if isinstance(d, ast.Attribute):
            return d.attr == "patch"
        return isinstance(d, ast.Name) and d.id in ("patch", "patch_to")
    if not any(is_patch(d) for d in fn.decorator_list) or not fn.args.args:
        return set()
    annotation = fn.args.args[0].annotation
    return {x.id for x in ast.walk(annotation) if isinstance(x, ast.Name)} if annotation is not None else set()


def _attribute_bases(tree):
    """Names whose attributes the cell's top-level statements set: `Scheduler.schedule = schedule` -> {'Scheduler'},
    and the classes its `@patch` functions add methods to."""
    out = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out |= _patched_classes(stmt)
            continue
        if isinstance(stmt, ast.Assign): targets = stmt.targets
        elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)): targets = [stmt.target]
        else: continue
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Attribute) and isinstance(x.ctx, ast.Store):
                    base = x.value
                    while isinstance(base, ast.Attribute): base = base.value
                    if isinstance(base, ast.Name): out.add(base.id)
    return out


def _names(source: str):
    "names() plus the names whose attributes the cell sets (a method attached to a class after its definition)."
    import symtable
    src = _python(source)
    try: tree, top = ast.parse(src), symtable.symtable(src, "<cell>", "exec")
    except SyntaxError: return set(), set(), False, set()
    defs = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    order = _Order(); order.visit(tree)
    uses = {n for n, p in order.loads.items() if n not in order.stores or p < order.stores[n]}
    inner, stack = set(), list(top.get_children())
    while stack:  # functions, classes, comprehensions: free names resolve in the notebook's namespace when they run
        t = stack.pop(); stack += t.get_children()
        inner |= {s.get_name() for s in t.get_symbols() if s.is_global()}
    imports = any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body)
    return defs, uses | (inner - defs), imports, _attribute_bases(tree)


def _only_imports(source: str) -> bool:
    "Whether every top-level statement of a cell is an import."
    try: body = ast.parse(_python(source)).body
    except SyntaxError: return False
    return all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body)


def setup_cells(nb, ex: Exercise) -> list[int]:
    """Indices of the code cells before exercise `ex` that it and its check need, in notebook order: every cell of
    imports only (an import may register something), and (transitively, walking backwards) the latest cell defining
    each name they read, plus every cell in between that sets an attribute of one (`Scheduler.schedule = schedule`, or
    a method added with `@patch`: methods attached after the class). A cell that imports and then measures something is run only if a name it
    defines is needed. Cells flagged notest/gpu/slow and nbdev's export call are never run."""
    _, need, _ = names(nb.cells[ex.cell].source)
    need |= names(nb.cells[ex.check].source)[1]
    keep = []
    for i in range(ex.cell - 1, -1, -1):
        c = nb.cells[i]
        if c.cell_type != "code" or _TEST_FLAGS.search(c.source) or "nbdev_export()" in c.source: continue
        defs, uses, imports, extends = _names(c.source)
        if (imports and _only_imports(c.source)) or defs & need or extends & need:
            keep.append(i)
            need = (need - defs) | uses
    return keep[::-1]


def notebooks(nbs: Path = NBS): return sorted(p for p in nbs.glob("*.ipynb") if not p.name.startswith("."))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "workshop"), help="folder for the student notebooks (default: workshop/)")
    ap.add_argument("--nbs", default=str(NBS), help="folder of the course notebooks (default: nbs/)")
    a = ap.parse_args(argv)
    out, nbs = Path(a.out), Path(a.nbs)
    if out.exists(): shutil.rmtree(out)
    out.mkdir(parents=True)
    total = 0
    for p in notebooks(nbs):
        nb, exercises = student_notebook(p)
        nbformat.validate(nb)
        nbformat.write(nb, out / p.name)
        total += len(exercises)
        print(f"{p.name:32s} {len(exercises)} exercise(s)" + (": " + ", ".join(n for e in exercises for n in e.functions) if exercises else ""))
    for extra in nbs.iterdir():  # images and data the notebooks refer to
        if extra.is_file() and extra.suffix.lower() in {".png", ".jpg", ".jpeg", ".gif", ".svg", ".csv", ".json", ".txt"}:
            shutil.copy2(extra, out / extra.name)
    print(f"wrote {out} ({total} exercises). Start with: jupyter lab {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__": sys.exit(main())
