"""Workshop mode: every exercise's check fails on the student stub and passes with the solution restored.

For each exercise, a fresh IPython shell (execnb's, as nbdev-test uses) runs only the cells the exercise and its check
need (`workshop.setup_cells`: cells of imports only, the latest cell defining each name they read and the cells that
attach methods to it), then the stub and the check (must raise), then the solution and the check (must pass).
"""
import ast, gc, os, sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import workshop  # noqa: E402

try:
    EXERCISES, BROKEN = [(p, ex) for p in workshop.notebooks() for ex in workshop.find_exercises(p)], None
except ValueError as e:  # reported by the first test rather than as a collection error
    EXERCISES, BROKEN = [], str(e)


def test_convention_is_followed():
    "Every exercise parses: functions only, a check after it, never exported (find_exercises raises otherwise)."
    assert BROKEN is None, BROKEN
    assert EXERCISES, "no exercises found in nbs/: chapters 00a and 00b have some"
    for p, ex in EXERCISES:
        assert ex.functions and ex.check > ex.cell, ex.id


def test_stub_keeps_signature_and_docstring_and_drops_the_solution():
    src = ('#| exercise\n# hint: think "rows"\ndef f(x, y=2, *, k=3):\n    "Doc of f."\n    # the answer\n'
           '    return x + y\n\ndef g(a): return a * 2\n')
    stub = workshop.stub_source(src)
    tree = ast.parse(stub)
    f, g = tree.body
    assert ast.unparse(f.args) == "x, y=2, *, k=3" and ast.get_docstring(f) == "Doc of f."
    assert "return" not in stub and "the answer" not in stub
    assert stub.splitlines()[:2] == src.splitlines()[:2]  # directive and hint stay for the student
    for fn in (f, g):
        ns = {}
        exec(compile(ast.Module([fn], []), "<stub>", "exec"), ns)
        with pytest.raises(NotImplementedError, match='think "rows"'): ns[fn.name](1)


def test_broken_convention_is_reported(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("#| exercise\nx = 1\ndef f(): return x")])
    nbformat.write(nb, tmp_path / "bad.ipynb")
    with pytest.raises(ValueError, match="bad.ipynb, cell 0: an exercise cell holds only function definitions"):
        workshop.find_exercises(tmp_path / "bad.ipynb")
    nb.cells = [nbformat.v4.new_code_cell("#| exercise\ndef f(): return 1")]
    nbformat.write(nb, tmp_path / "bad.ipynb")
    with pytest.raises(ValueError, match="followed by a code cell that checks it"):
        workshop.find_exercises(tmp_path / "bad.ipynb")


def test_setup_keeps_cells_that_attach_methods():
    "A method attached after its class (`Scheduler.schedule = schedule`, as 06a does) is part of the class's setup."
    cells = ["import math", "class A:\n    pass", "def go(self): return 1\n\nA.go = go", "unrelated = 3",
             "#| exercise\ndef f(a): return a.go()", "assert f(A()) == 1"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    ex = workshop.Exercise(Path("x.ipynb"), cell=4, check=5, functions=["f"], hint=None)
    assert workshop.setup_cells(nb, ex) == [0, 1, 2]


def test_setup_keeps_cells_that_patch_methods():
    "A method a later cell of the chapter adds with fastcore's `@patch` (as 06a, 06b and 07a do) is setup too."
    cells = ["from fastcore.basics import patch", "class A:\n    pass", "@patch\ndef go(self: A): return 1",
             "unrelated = 3", "#| exercise\ndef f(a): return a.go()", "assert f(A()) == 1"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    ex = workshop.Exercise(Path("x.ipynb"), cell=4, check=5, functions=["f"], hint=None)
    assert workshop.setup_cells(nb, ex) == [0, 1, 2]


def test_setup_skips_a_measurement_that_only_imports_on_the_way():
    "A cell that imports and then measures is set up only if the exercise needs what it defines; pure imports always."
    cells = ["import math", "from time import perf_counter\nslow = [perf_counter() for _ in range(3)]",
             "from os import sep\nneeded = sep", "#| exercise\ndef f(): return needed", "assert f()"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    ex = workshop.Exercise(Path("x.ipynb"), cell=3, check=4, functions=["f"], hint=None)
    assert workshop.setup_cells(nb, ex) == [0, 2]


def test_workshop_writes_student_copies(tmp_path):
    assert workshop.main(["--out", str(tmp_path / "ws")]) == 0
    written = sorted(p.name for p in (tmp_path / "ws").glob("*.ipynb"))
    assert written == [p.name for p in workshop.notebooks()]
    for p, ex in EXERCISES:
        nb = nbformat.read(tmp_path / "ws" / p.name, as_version=4)
        nbformat.validate(nb)
        cleared = [c for c in nb.cells if c.cell_type == "code" and not workshop._KEEP_OUTPUTS.search(c.source)]
        assert all(not c.get("outputs") for c in cleared), f"{p.name}: outputs not cleared"
        assert not any("nbdev_export()" in c.source for c in nb.cells)
        stubs = [c for c in nb.cells if workshop.is_exercise(c)]
        assert all("NotImplementedError" in c.source for c in stubs)
        orig = nbformat.read(p, as_version=4)
        by_id = {c.id: c for c in nb.cells}
        assert by_id[orig.cells[ex.check].id].source == orig.cells[ex.check].source, f"{ex.id}: check cell not kept"
        assert by_id[orig.cells[ex.cell].id].source == workshop.stub_source(orig.cells[ex.cell].source)


def _run(shell, source):
    shell.run(source)
    return shell.exc


@pytest.mark.parametrize("nb_path,ex", EXERCISES, ids=[ex.id for _, ex in EXERCISES])
def test_check_fails_on_stub_and_passes_with_solution(nb_path, ex, monkeypatch):
    from execnb.shell import CaptureShell
    nb = nbformat.read(nb_path, as_version=4)
    monkeypatch.chdir(nb_path.parent)  # as nbdev-test runs them
    monkeypatch.setenv("MPLBACKEND", "Agg")
    shell = CaptureShell(mpl_format=None)
    try: _check_exercise(shell, nb, nb_path, ex)
    finally:
        # stop what a setup cell left running in the background (chapter 07d starts a server in a cell with imports;
        # the cell that stops it is not setup): its engine thread would outlive the namespace it runs in
        for obj in list(shell.user_ns.values()):
            if type(obj).__name__ in ("ServerThread", "EngineLoop"): obj.stop()
        # free the chapter's models before the next exercise: the whole suite would otherwise hold them all
        shell.reset(new_session=False)
        gc.collect()


def _check_exercise(shell, nb, nb_path, ex):
    for i in workshop.setup_cells(nb, ex):
        exc = _run(shell, nb.cells[i].source)
        assert exc is None, f"{nb_path.name} cell {i} (setup for {ex.id}) failed: {exc!r}"
    solution, check = nb.cells[ex.cell].source, nb.cells[ex.check].source
    exc = _run(shell, workshop.stub_source(solution))
    assert exc is None, f"defining the stub failed: {exc!r}"
    exc = _run(shell, check)
    assert exc is not None, f"{ex.id}: the check passes even with the stub: it does not test the exercise"
    exc = _run(shell, solution)
    assert exc is None, f"{ex.id}: the solution cell failed: {exc!r}"
    exc = _run(shell, check)
    assert exc is None, f"{ex.id}: the check fails with the solution: {exc!r}"


def test_slow_and_gpu_cells_keep_their_stored_outputs(tmp_path):
    "A measurement too slow (or impossible) to re-run in class keeps its stored run in a student copy; others are cleared."
    stored = [nbformat.v4.new_output("stream", name="stdout", text="perplexity 12.3\n")]
    cells = [nbformat.v4.new_code_cell("#| slow\nprint('perplexity 12.3')", outputs=stored),
             nbformat.v4.new_code_cell("#| gpu\nprint('tokens/s')", outputs=stored),
             nbformat.v4.new_code_cell("print('quick')", outputs=stored)]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "x.ipynb")
    nb, _ = workshop.student_notebook(tmp_path / "x.ipynb")
    assert [len(c.outputs) for c in nb.cells] == [1, 1, 0]
    assert nb.cells[0].outputs[0].text == "perplexity 12.3\n"
    kept = 0  # and in the real chapters: every slow cell's stored outputs survive `make workshop`
    for p in workshop.notebooks():
        orig, (student, _) = nbformat.read(p, as_version=4), workshop.student_notebook(p)
        by_id = {c.id: c for c in student.cells}
        for c in orig.cells:
            if c.cell_type == "code" and workshop._KEEP_OUTPUTS.search(c.source) and c.outputs:
                assert by_id[c.id].outputs == c.outputs, f"{p.name}: slow cell {c.id} lost its outputs"
                kept += 1
    assert kept, "no slow cell with stored outputs found in nbs/ (chapter 08 has several)"


def test_a_solution_shown_above_its_stub_is_found(tmp_path):
    "A function above the exercise with the solution's body, local names changed, is caught; a different one is not."
    shown = ("def library_sum(values, start=0):\n    total = start\n    for v in values:\n        total = total + v * 2\n"
             "    return total")
    other = "def unrelated(path):\n    with open(path) as f:\n        return [ln.split(',') for ln in f if ln.strip()]"
    exercise = ('#| exercise\ndef my_sum(xs, s=0):\n    "Doc."\n    acc = s\n    for x in xs:\n'
                '        acc = acc + x * 2\n    return acc')
    for above, expected in ((shown, 1), (other, 0)):
        cells = [nbformat.v4.new_code_cell(c) for c in (above, exercise, "assert my_sum([1]) == 2")]
        nb = nbformat.v4.new_notebook(cells=cells)
        nbformat.write(nb, tmp_path / "x.ipynb")
        exercises = workshop.find_exercises(tmp_path / "x.ipynb")
        found = workshop.shown_solutions(nb.cells, exercises)
        assert len(found) == expected, found
        if expected:
            with pytest.raises(ValueError, match="exercise `my_sum` .* is shown above its stub as `library_sum`"):
                workshop.student_notebook(tmp_path / "x.ipynb")


def test_a_solution_cell_becomes_a_library_import(tmp_path):
    "`#| solution` on an exported cell: the student copy imports its names and keeps its other statements."
    src = ('#| export\n#| solution\nLIMIT = 3\n\ndef library_sum(values):\n    "Doc."\n    return sum(values)\n\n'
           'REGISTRY["sum"] = library_sum')
    exercise = '#| exercise\ndef my_sum(xs):\n    "Doc."\n    return sum(xs)'
    cells = ["#| default_exp tools_demo", src, exercise, "assert my_sum([1]) == 1"]
    original = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(original, tmp_path / "x.ipynb")
    nb, _ = workshop.student_notebook(tmp_path / "x.ipynb")
    solution_cell = next(c for c in nb.cells if c.id == original.cells[1].id)
    lines = solution_cell.source.splitlines()
    assert lines[1:] == ["from minfer.tools_demo import LIMIT, library_sum", 'REGISTRY["sum"] = library_sum'], lines
    assert "return sum(values)" not in solution_cell.source
    cells[1] = src.replace("#| export\n", "")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), tmp_path / "x.ipynb")
    with pytest.raises(ValueError, match="must be `#| export`ed"): workshop.student_notebook(tmp_path / "x.ipynb")


@pytest.mark.parametrize("nb_path", sorted({p for p, _ in EXERCISES}), ids=lambda p: p.stem)
def test_no_solution_is_shown_above_its_stub(nb_path):
    """In the student copy no function above an exercise has (nearly) its solution's body (`workshop.shown_solutions`;
    `student_notebook` refuses such a copy): the exercise comes first, or the solving cell is marked `#| solution`."""
    try: student, _ = workshop.student_notebook(nb_path)
    except ValueError as e: pytest.fail(str(e))
    assert not any(workshop.is_solution(c) for c in student.cells), "a `#| solution` cell was left as it is"
