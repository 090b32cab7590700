"""Build the course site: nbs/*.ipynb -> docs/ (static HTML), with pip-installable tools only.

    python tools/build_docs.py              # build into docs/ (and README.md from nbs/index.ipynb)
    python tools/build_docs.py --if-stale   # do nothing if docs/ was built from exactly these inputs

Steps:
 1. every notebook in nbs/ (filename order) goes through nbdev's `NBProcessor` with nbdev's own processors for its
    directives (`#| hide`, `hide_line`, `filter_stream`, ANSI and magics cleanup) plus this site's: `#| export` cells
    stay visible (they are the course) under a line naming what they export, linked to the API reference and
    targeted by it; `show_doc(X)` cells become autodoc entries; exercise solutions and `#| code-fold: true` cells
    fold away (myst-nb's hide-input: a "Show the code" toggle); widget outputs, which need a live kernel, become a
    note; `#| gpu`/`slow`/`notest` cells get a flag. Stored outputs are kept: nothing is executed.
 2. API pages: one per `minfer` module, Sphinx autodoc over its `__all__`; each name links back to the notebook cell
    that exports it (found through the `# %% ../nbs/X.ipynb #cellid` markers nbdev writes into the modules).
 3. the instructor guide, generated from the notebooks (chapters, exercises, GPU parts, suggested workshop plans) and
    tools/chapter_times.json.
 4. Sphinx (myst-nb, sphinx-book-theme) with warnings as errors and nitpicky references, then a copy into docs/.
"""
from __future__ import annotations

import argparse, ast, hashlib, json, os, re, shutil, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
NBS, LIB, DOCS = ROOT / "nbs", ROOT / "minfer", ROOT / "docs"
BUILD = ROOT / "_build" / "site"
SRC, HTML = BUILD / "src", BUILD / "html"
GLOSSARY = NBS / "glossary.md"  # the course's terms, one sense each: a page of the site's Reference part
STAMP = DOCS / ".build-inputs"
TIMES = TOOLS / "chapter_times.json"
ASSETS = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}
sys.path.insert(0, str(TOOLS))
import readme, workshop  # noqa: E402

_CELL_MARK = re.compile(r"^# %% \.\./nbs/(\S+)\.ipynb(?: #(\S+))?", re.MULTILINE)
_FLAGS = ("gpu", "slow", "notest")
_FLAG_TEXT = {"gpu": "needs a CUDA GPU: skipped on CPU (`make test`); its output, if any, was recorded on a GPU machine",
              "slow": "slow: skipped by `make test`; run it yourself when you have a few minutes",
              "notest": "not run by `make test`"}


# ---------------------------------------------------------------- inputs and staleness
def notebooks(): return workshop.notebooks(NBS)


def input_files():
    files = [*notebooks(), *(p for p in NBS.rglob("*") if p.suffix.lower() in ASSETS), *sorted(LIB.glob("*.py")),
             *(p for p in (TOOLS / "sphinx").rglob("*") if p.is_file() and "__pycache__" not in p.parts),
             TOOLS / "build_docs.py", TOOLS / "workshop.py", TOOLS / "readme.py", TIMES, GLOSSARY]
    return sorted({p for p in files if p.exists()})


def inputs_hash():
    h = hashlib.sha256()
    for p in input_files():
        h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def is_stale():
    return not (DOCS / "index.html").exists() or not STAMP.exists() or STAMP.read_text().strip() != inputs_hash()


# ---------------------------------------------------------------- where each public name is built
def module_names():
    "minfer modules to document: every public minfer/*.py that nbdev generated (it has __all__), in chapter order."
    out = []
    for p in LIB.glob("*.py"):
        if p.stem.startswith("_"): continue
        src = p.read_text()
        if "__all__" not in src: continue
        m = re.search(r"File to edit: \.\./nbs/(\S+)\.ipynb", src)
        out.append((m.group(1) if m else "~", f"minfer.{p.stem}"))
    return [m for _, m in sorted(out)]


def symbol_cells():
    """{'minfer.model.RMSNorm': (notebook stem, cell id)} for every name in each module's `__all__`, read from the
    `# %% ../nbs/X.ipynb #cellid` markers nbdev writes above each exported cell."""
    out = {}
    for mod in module_names():
        src = (LIB / f"{mod.split('.')[1]}.py").read_text()
        tree = ast.parse(src)
        public = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                       and any(getattr(t, "id", None) == "__all__" for t in n.targets)), [])
        marks = [(src.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in _CELL_MARK.finditer(src)]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): defined = [node.name]
            elif isinstance(node, ast.Assign):
                defined = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name): defined = [node.target.id]
            else: continue
            line = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
            mark = max((m for m in marks if m[0] < line), default=None)
            for name in defined:
                if name in public and mark and f"{mod}.{name}" not in out: out[f"{mod}.{name}"] = (mark[1], mark[2])
    return out


def label(fullname): return "src-" + fullname.lower()


def plain(title):
    "A chapter title as plain text that is safe inside an RST role: `:ref:`title <label>``."
    return re.sub(r"[`*]", "", title).replace("<", "\\<").strip()


# ---------------------------------------------------------------- notebook processing
def chapter_title(nb, default):
    for c in nb.cells:
        if c.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", c.source, re.MULTILINE)
            if m: return m.group(1).strip()
    return default


def chapter_summary(nb):
    for c in nb.cells:
        if c.cell_type == "markdown":
            m = re.search(r"^>\s*(.+(?:\n>\s*\S.*)*)", c.source, re.MULTILINE)  # a quote may wrap over several lines
            if m: return " ".join(l.lstrip(">").strip() for l in m.group(1).splitlines())
    return ""


def _md(text, **meta):
    from fastcore.nbio import mk_cell
    c = mk_cell(text, "markdown")
    c.metadata.update(meta)
    return c


def link_names(md, short_names):
    "Turn `Name` (a public minfer name) in markdown prose into a cross-reference; code fences are left alone."
    out, fence = [], None
    for line in md.split("\n"):
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if m:
            fence = None if fence and m.group(1).startswith(fence) else (fence or m.group(1))
            out.append(line); continue
        if fence is None and not line.lstrip().startswith("#"):  # not in code, not in headings (they become titles)
            line = re.sub(r"(?<![`{])`([A-Za-z_][\w.]*)`(?!`)",
                          lambda m: f"{{py:obj}}`~{short_names[m.group(1)]}`" if m.group(1) in short_names else m.group(0),
                          line)
        out.append(line)
    return "\n".join(out)


def process_notebook(path, symbols, titles):
    "The notebook as the site shows it (a fastcore AttrDict notebook)."
    from fastcore.nbio import read_nb
    from nbdev.process import NBProcessor
    from nbdev.processors import (populate_language, strip_ansi, hide_line, filter_stream_, rm_header_dash, hide_,
                                  clean_magics, strip_hidden_metadata)
    nb = read_nb(path)
    stem = path.stem
    # names this notebook exports, and the short names a reader may write in prose (`RMSNorm`), for links
    here = {n: cid for n, (s, cid) in symbols.items() if s == stem}
    short = {}
    for full, (s, _) in symbols.items():
        short.setdefault(full.rsplit(".", 1)[1], set()).add(full)
    short = {k: (sorted(v)[0] if len(v) == 1 else next((f for f in v if f in here), None)) for k, v in short.items()}
    short.update({m: m for m in module_names()})
    short = {k: v for k, v in short.items() if v}

    def site_cells(cell):
        "This site's handling of one cell (runs after nbdev's processors); returns the cells that replace it."
        d = cell.directives_
        if cell.cell_type == "markdown":
            src = cell.source
            if stem == "index": src = readme.link_chapters(src, "", NBS)
            cell.source = link_names(src, short)
            return [cell]
        if cell.cell_type != "code": return [cell]
        if "default_exp" in d or "nbdev_export()" in cell.source or not cell.source.strip(): return []
        if str(d.get("include", "")).lower() == "false": return []
        # Quarto-style options that nbdev notebooks use: echo (show the code), output (show the outputs)
        tags = cell.metadata.setdefault("tags", [])
        if str(d.get("echo", "")).lower() == "false": tags.append("remove-input")
        if str(d.get("output", "")).lower() == "false": tags.append("remove-output")
        if not tags: cell.metadata.pop("tags")
        if re.match(r"^\s*show_doc\(", cell.source):  # nbdev's show_doc: an autodoc entry (defined on the API page)
            return [_show_doc(cell.source, short, symbols)]
        before = []
        if d.keys() & {"export", "exports"}:
            names = [n for n, cid in here.items() if cid == cell.get("id")]
            mod = next((m for m in module_names() if any(n.startswith(m + ".") for n in names)), None)
            if names:
                targets = "".join(f"({label(n)})=\n" for n in names)
                refs = ", ".join(f"{{py:obj}}`~{n}`" for n in names)
                before.append(_md(f"{targets}:::{{container}} minfer-exported\nExported to `{mod}`: {refs}\n:::"))
        for flag in _FLAGS:
            if flag in d:
                before.append(_md(f":::{{container}} minfer-flag\n**{flag}** · {_FLAG_TEXT[flag]}\n:::"))
                break
        if "exercise" in d:  # the solution folds away, under its own label
            tags = cell.metadata.setdefault("tags", [])
            if "hide-input" not in tags: tags.append("hide-input")
            cell.metadata["mystnb"] = {"code_prompt_show": "Show the solution", "code_prompt_hide": "Hide the solution"}
        elif str(d.get("code-fold", "false")).lower() in ("", "true"):  # Quarto's code-fold: a folded cell
            tags = cell.metadata.setdefault("tags", [])
            if "hide-input" not in tags: tags.append("hide-input")
            cell.metadata["mystnb"] = {"code_prompt_show": "Show the code", "code_prompt_hide": "Hide the code"}
        outs = []
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data:  # needs a live kernel: say so, don't render JS
                o = {"output_type": "display_data", "metadata": {}, "data": {"text/html":
                     '<p class="minfer-widget-note">Interactive controls appear here when this notebook runs in '
                     'Jupyter (<code>jupyter lab nbs/</code>); the figure above shows the default setting.</p>'}}
            outs.append(o)
        if "outputs" in cell: cell["outputs"] = outs
        return before + [cell]

    class SiteCells:
        def __init__(self, nb): self.nb = nb
        def begin(self):
            cells = []
            for c in self.nb.cells: cells += site_cells(c)
            self.nb.cells = cells

    procs = [populate_language, strip_ansi, hide_line, filter_stream_, rm_header_dash, hide_, clean_magics,
             strip_hidden_metadata, SiteCells]
    NBProcessor(nb=nb, procs=procs, rm_directives=True).process()
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("jupytext", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.setdefault("language_info", {"name": "python", "pygments_lexer": "ipython3"})
    if stem == "index":
        chapters = "\n".join(p.stem for p in notebooks() if p.stem != "index")
        nb.cells.append(_md(f"```{{toctree}}\n:hidden:\n:caption: Chapters\n:maxdepth: 2\n\n{chapters}\n```\n\n"
                            "```{toctree}\n:hidden:\n:caption: Reference\n\nglossary\ninstructor_guide\napi/index\n```"))
    for k in ("path_", "has_docs_"): nb.pop(k, None)
    for i, c in enumerate(nb.cells):
        for k in [k for k in c if k.endswith("_") and k != "source"]: c.pop(k)
    return nb


def _show_doc(source, short, symbols):
    m = re.match(r"^\s*show_doc\(\s*([A-Za-z_][\w.]*)", source)
    name = m.group(1) if m else ""
    head, _, rest = name.partition(".")
    full = short.get(head)
    if not full: raise ValueError(f"show_doc({name}): {head!r} is not a public name of any minfer module")
    full = f"{full}.{rest}" if rest else full
    import importlib, inspect
    mod = next(m for m in module_names() if full.startswith(m + "."))
    obj = importlib.import_module(mod)
    for part in full[len(mod) + 1:].split("."): obj = getattr(obj, part)
    kind = ("autoclass" if inspect.isclass(obj) else "automethod" if rest else
            "autofunction" if callable(obj) else "autodata")
    return _md(f"```{{eval-rst}}\n.. {kind}:: {full}\n   :no-index:\n```")


# ---------------------------------------------------------------- generated pages
def api_pages(symbols, titles):
    (SRC / "api").mkdir(parents=True, exist_ok=True)
    import importlib, inspect
    rows, mods = [], module_names()
    for mod in mods:
        m = importlib.import_module(mod)
        chapters = sorted({symbols[f"{mod}.{n}"][0] for n in getattr(m, "__all__", []) if f"{mod}.{n}" in symbols})
        built = ", ".join(f"[{titles[c]}](../{c}.ipynb)" for c in chapters if c in titles) or "—"
        rows.append(f"| {{py:mod}}`{mod}` | {built} |")
        entries = [f".. automodule:: {mod}", ""]
        for n in getattr(m, "__all__", []):
            obj, full = getattr(m, n), f"{mod}.{n}"
            if inspect.isclass(obj): entries += [f".. autoclass:: {full}", "   :members:", "   :undoc-members:", ""]
            elif callable(obj): entries += [f".. autofunction:: {full}", ""]
            else:  # module-level data: show the value when it is short
                entries += [f".. autodata:: {full}"] + (["   :no-value:"] if len(repr(obj)) > 160 else []) + [""]
        (SRC / "api" / f"{mod}.md").write_text(
            f"# `{mod}`\n\nBuilt in: {built}. Every name below links to the notebook cell that defines it.\n\n"
            "```{eval-rst}\n" + "\n".join(entries) + "\n```\n")
    pkg = importlib.import_module("minfer")
    top = [n for n in getattr(pkg, "__all__", []) if not n.startswith("_")]
    top_md = ""
    if top:
        links = ", ".join(f"{{py:obj}}`~{getattr(pkg, n).__module__}.{n}`" for n in top)
        top_md = f"\n`import minfer` gives: {links}.\n"
    (SRC / "api" / "index.md").write_text(
        "# API reference\n\nEvery public name of every `minfer` module (each module's `__all__`), with its signature "
        "and docstring, generated from the code the notebooks export.\n" + top_md +
        "\n| module | built in |\n| --- | --- |\n" + "\n".join(rows) +
        "\n\n```{toctree}\n:hidden:\n\n" + "\n".join(mods) + "\n```\n")


def _fmt_s(s): return f"{s:.0f} s" if s < 90 else f"{s/60:.1f} min"


# How long studying a chapter takes, estimated at stated rates (an estimate, not a measurement): its prose read at
# WORDS_PER_MIN, its code read and run cell by cell at CODE_LINES_PER_MIN, its cells' own run time, and
# EXERCISE_MIN per exercise. A chapter estimated above LONG_MIN is a candidate to split into parts.
WORDS_PER_MIN, CODE_LINES_PER_MIN, EXERCISE_MIN, LONG_MIN = 120, 10, 10, 120


def chapter_size(nb):
    "-> (words of prose, lines of code) of a notebook: markdown words; code lines that are not blank or directives."
    words = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    code = sum(1 for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines()
               if line.strip() and not line.lstrip().startswith("#|"))
    return words, code


def study_minutes(words, code_lines, run_seconds, exercises):
    "Estimated minutes to read and run a chapter cell by cell, at the rates above."
    return words / WORDS_PER_MIN + code_lines / CODE_LINES_PER_MIN + run_seconds / 60 + exercises * EXERCISE_MIN


def _fmt_min(m): return f"{m:.0f} min" if m < 90 else f"{m / 60:.1f} h"


# Suggested workshop plans: (name, what it assumes, [(minutes, chapter number prefixes, what the block does)]).
# Chapters are named by their number (`02a`), so a plan lists exactly the chapters, exercises and run times there are.
WORKSHOP_PLANS = [
    ("Half day", "Laptops without a GPU; the core path from a model folder to a batching engine.", [
        (30, ["00", "00a", "00b"], "what a model is and why decode is memory-bound: bytes per token, this machine's roofline"),
        (40, ["01", "02a"], "recompute against cache: the naive loop, then the KV cache; compare the two time-per-token "
                            "curves"),
        (15, [], "break"),
        (40, ["03", "04"], "paging and sharing: block tables, then the radix prefix cache"),
        (45, ["06a", "06b"], "continuous batching: the scheduler's budget, then the engine's static-vs-continuous "
                             "measurement (show the stored outputs where laptops are slow)"),
        (20, ["07a", "07e"], "everything as switches: `LLM`, `minfer generate` and `minfer bench` with a switch off and "
                             "on"),
    ]),
    ("Full day", "The engine of part I end to end, then the attacks of part II; one GPU in the room for chapter 05a's "
                 "measured part, if there is one.", [
        (30, ["00", "00a", "00b"], "what a model is and why decode is memory-bound"),
        (40, ["01", "02a"], "recompute against cache"),
        (30, ["02b", "02c", "02d"], "sampling, the `Sequence` and a first engine"),
        (15, [], "break"),
        (40, ["03", "04"], "paging and sharing"),
        (50, ["05a"], "FlashAttention: the online softmax in PyTorch, then the Triton kernels (interpreted on a CPU: "
                      "slow, keep shapes small; compiled and measured on a GPU)"),
        (45, [], "lunch"),
        (50, ["05b", "05c"], "the CPU's answer: C++ kernels, a matvec at the memory's pace, one call per decode step"),
        (45, ["06a", "06b"], "continuous batching: scheduler and engine"),
        (40, ["07a", "07b", "07c", "07d", "07e", "07f"], "the API, the wire format, the engine loop, the HTTP server, "
                                                        "the command line and the chat page; students benchmark "
                                                        "their own machine"),
        (15, [], "break"),
        (25, ["08"], "fewer bytes per weight: INT4 weights with AWQ's scales, and what they cost in perplexity"),
        (25, ["09", "09a"], "fewer bytes per cached token: a quantized KV cache in 8 bits, then in 4 (KIVI)"),
        (30, ["10", "10a", "10b", "10c"], "more tokens per weight read: a step's time against its rows, "
                                          "speculative decoding, an EAGLE head on the target's own features, "
                                          "then token trees"),
        (20, ["11"], "prefill and decode apart: the prefill/decode split"),
    ]),
]


def workshop_plans(chapters):
    "Markdown for WORKSHOP_PLANS; `chapters`: number prefix -> (title, file name, exercise names, run time text)."
    out = []
    for name, assumes, blocks in WORKSHOP_PLANS:
        present = [b for b in blocks if not b[1] or any(n in chapters for n in b[1])]  # planned chapters not written yet drop out
        hours = sum(m for m, _, _ in present) / 60
        lines = [f"### {name} (about {hours:.1f} hours)", "", f"{assumes} Minutes are teaching time; run times are the "
                 "notebooks' own, under `nbdev-test`.", ""]
        for minutes, numbers, what in blocks:
            have = [chapters[n] for n in numbers if n in chapters]
            if numbers and not have: continue  # a planned chapter not written yet
            links = ", ".join(f"[{title}]({file})" for title, file, _, _ in have) or what.capitalize()
            line = f"- **{minutes} min** · {links}" + (f": {what}." if have else ".")
            exercises = [f"`{e}`" for _, _, exs, _ in have for e in exs]
            if exercises: line += " Exercises: " + ", ".join(exercises) + "."
            if have: line += " Runs in: " + "; ".join(run for _, _, _, run in have) + "."
            lines.append(line)
        planned = {n for _, numbers, _ in blocks for n in numbers}
        rest = [chapters[n] for n in sorted(chapters) if n not in planned]  # chapters added since the plan was written
        if rest:
            lines.append("- Not in this plan (for students who finish early, or a longer day): "
                         + ", ".join(f"[{title}]({file})" for title, file, _, _ in rest) + ".")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def instructor_guide(titles):
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {"chapters": {}}
    import nbformat
    rows, details, n_ex, chapters, study, study_total = [], [], 0, {}, [], 0.0
    for p in notebooks():
        if p.stem == "index": continue
        nb = nbformat.read(p, as_version=4)
        exs = workshop.find_exercises(p, nb)
        n_ex += len(exs)
        gpu, slow, section = [], [], ""
        for c in nb.cells:
            if c.cell_type == "markdown":
                hs = re.findall(r"^#{1,6}\s+(.+)$", c.source, re.MULTILINE)
                if hs: section = hs[-1].strip()
            elif c.cell_type == "code" and re.search(r"^\s*#\|\s*gpu\b", c.source, re.MULTILINE):
                if section not in gpu: gpu.append(section)
            elif c.cell_type == "code" and re.search(r"^\s*#\|\s*slow\b", c.source, re.MULTILINE):
                if section not in slow: slow.append(section)
        t = times["chapters"].get(p.name)
        if t is None: run = "not measured yet"
        else:
            run = _fmt_s(t["seconds"])
            if t.get("load", 0) > times.get("cores", 2) + 0.5: run += f" (busy machine, load {t['load']:g}: an upper bound)"
            if t.get("code_hash") != code_hash(p): run += " (measured on an earlier version)"
        if slow: run += "; not counted, slow cells (stored outputs; `nbdev-test --flags slow`): " + "; ".join(slow)
        title = titles[p.stem]
        words, code = chapter_size(nb)
        minutes = study_minutes(words, code, t["seconds"] if t else 0, len(exs))
        study.append(f"| [{title}]({p.name}) | {words:,} | {code:,} | {len(exs)} | **{_fmt_min(minutes)}**"
                     + (" (long: a candidate to split)" if minutes > LONG_MIN else "") + " |")
        study_total += minutes
        ex_cell = "<br>".join(f"`{e.signatures[0]}`" for e in exs) or "—"
        gpu_cell = ("yes: " + "; ".join(gpu)) if gpu else "no"
        rows.append(f"| [{title}]({p.name}) | {chapter_summary(nb) or '—'} | {ex_cell} | {run} | {gpu_cell} |")
        chapters[p.stem.split("_")[0]] = (title, p.name, [f for e in exs for f in e.functions],
                                          _fmt_s(t["seconds"]) if t else "not measured yet")
        if exs:
            items = []
            for e in exs:
                what = e.title.replace("Exercise · ", "") if e.title else ", ".join(e.functions)
                items.append(f"- **{what}** (section *{e.section}*): write " + ", ".join(f"`{s}`" for s in e.signatures)
                             + (f". Hint given to students: *{e.hint}*" if e.hint else "") + ".")
            details.append(f"### {title}\n\n" + "\n".join(items))
    machine = times.get("machine", "")
    when = times.get("measured", "")
    text = f"""# Instructor guide

How to run minfer as a workshop: what each chapter teaches, the exercises students write, how long each notebook
takes to run, and which parts need a GPU. This page is generated from the notebooks by `make docs`, so it lists
exactly the chapters and exercises in the repository.

## Before the session

- Every student needs Python 3.10+, about 3 GB of disk and no GPU. `make install` (or `make demo`) sets up `.venv`,
  installs a CPU build of PyTorch and converts the default model once; do it before the session, the download is the slow part.
- `make workshop` writes `workshop/`: a student copy of every notebook where each exercise function keeps its signature
  and docstring but its body is `raise NotImplementedError("<hint>")`; the cell after each exercise is its check
  (asserts), kept as is; outputs are cleared, except those of `slow` and `gpu` cells (measurements too slow, or
  impossible, to re-run in class: students read the stored run). An exported cell marked `#| solution` (code an
  exercise below re-creates) becomes an import from the library, so no solution shows above its stub. Students open
  it with `.venv/bin/jupyter lab workshop/`.
- `tests/test_workshop.py` (part of `make test`) proves every check fails on the stub and passes with the solution, so
  a green check means the student's function is right.
- On this site, exercise solutions are folded: click *Show the solution* under an exercise.

## Chapters

Run time is one notebook under `nbdev-test` (GPU and slow cells skipped) on a 2-core CPU{f" ({machine}, measured {when})" if machine else ""};
students reading and running cell by cell need far longer. Re-measure with `python tools/time_chapters.py`.
{("Note: " + times["note"] + ".") if times.get("note") else ""}

| chapter | what it teaches | exercises | runs in | needs a GPU |
| --- | --- | --- | --- | --- |
{chr(10).join(rows)}

## How long studying a chapter takes (estimates)

Estimated, not measured: prose read at {WORDS_PER_MIN} words a minute, code read and run cell by cell at
{CODE_LINES_PER_MIN} lines a minute, plus the notebook's run time above and {EXERCISE_MIN} minutes per exercise.
Chapters above {LONG_MIN // 60} hours are marked: they are candidates to split into parts. The whole course: about
**{study_total / 60:.0f} hours** of study.

| chapter | words of prose | lines of code | exercises | study time |
| --- | --- | --- | --- | --- |
{chr(10).join(study)}

## Suggested workshop plans

Two plans built from the chapters above; each block names its chapters, the exercises students write in it and how
long its notebooks take to run (the table above says which times predate the current version). Put the exercises
first: students who finish early read on in the chapter.

{workshop_plans(chapters)}

{"## Exercises" if details else ""}

{chr(10).join(details) if details else ""}

## Adding an exercise

A code cell whose first line is `#| exercise`, optionally `# hint: <text>` on the second line, then one or more
top-level function definitions: the solution. The next code cell is the check: asserts that fail with a stub and
pass with the solution. Put a markdown cell before it that starts with **Exercise · title.** and says what to write.
Keep exercise cells out of `#| export`, and show no solution above its stub: put the exercise before the code that
solves it, or mark that (exported) cell `#| solution` (`tools/workshop.py` explains the rule). Then run `make workshop`
and `pytest tests/test_workshop.py`.
"""
    (SRC / "instructor_guide.md").write_text(text)
    return n_ex


def code_hash(nb_path):
    "Hash of a notebook's code (not its outputs): timings stay valid across re-execution."
    import nbformat
    nb = nbformat.read(nb_path, as_version=4)
    return hashlib.sha256("\0".join(c.source for c in nb.cells if c.cell_type == "code").encode()).hexdigest()[:16]


# ---------------------------------------------------------------- build
SPHINX_PAGES = {"genindex", "search", "py-modindex"}  # pages Sphinx writes without a source of their own


def drop_pages_of_gone_sources():
    """Sphinx's incremental build keeps the page of a source that is gone (a chapter renamed or split): remove every
    page in the build whose notebook or markdown file is no longer among the sources, so the site does not ship it."""
    sources = {p.relative_to(SRC).with_suffix("") for p in SRC.rglob("*") if p.suffix in (".ipynb", ".md")}
    for page in list(HTML.rglob("*.html")) if HTML.exists() else []:
        name = page.relative_to(HTML).with_suffix("")
        if name.parts[0] != "_static" and name.name not in SPHINX_PAGES and name not in sources:
            page.unlink()


def build(jobs="auto"):
    t0 = time.time()
    from fastcore.nbio import write_nb
    if SRC.exists(): shutil.rmtree(SRC)
    (SRC / "_ext").mkdir(parents=True)
    shutil.copy2(TOOLS / "sphinx" / "conf.py", SRC / "conf.py")
    shutil.copy2(TOOLS / "sphinx" / "mathml.py", SRC / "_ext" / "mathml.py")
    shutil.copytree(TOOLS / "sphinx" / "_static", SRC / "_static")
    shutil.copy2(GLOSSARY, SRC / "glossary.md")
    for p in NBS.rglob("*"):  # images the notebooks' markdown refers to
        if p.suffix.lower() in ASSETS and ".ipynb_checkpoints" not in p.parts:
            (SRC / p.relative_to(NBS)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, SRC / p.relative_to(NBS))
    import nbformat
    nbs = notebooks()
    if not any(p.stem == "index" for p in nbs): raise SystemExit("nbs/index.ipynb is missing: it is the landing page")
    titles = {p.stem: chapter_title(nbformat.read(p, as_version=4), p.stem) for p in nbs}
    symbols = symbol_cells()
    (SRC / "_symbols.json").write_text(json.dumps(
        {n: {"label": label(n), "chapter": s, "title": plain(titles.get(s, s))} for n, (s, _) in symbols.items()}, indent=1))
    for p in nbs:
        write_nb(process_notebook(p, symbols, titles), SRC / p.name)
    api_pages(symbols, titles)
    n_ex = instructor_guide(titles)
    print(f"prepared {len(nbs)} notebooks, {len(module_names())} API pages, {n_ex} exercises in {time.time()-t0:.1f} s")

    drop_pages_of_gone_sources()
    warnings = BUILD / "warnings.txt"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-n", "-q", "-j", str(jobs),
           "-d", str(BUILD / "doctrees"), "-w", str(warnings), str(SRC), str(HTML)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MPLBACKEND": "Agg"}
    r = subprocess.run(cmd, cwd=ROOT, env=env)
    text = warnings.read_text().strip() if warnings.exists() else ""
    if r.returncode != 0 or text:
        print(f"sphinx reported problems (exit {r.returncode}); see {warnings.relative_to(ROOT)}:\n{text}", file=sys.stderr)
        raise SystemExit(1)

    tmp = DOCS.with_name("docs.new")
    if tmp.exists(): shutil.rmtree(tmp)
    shutil.copytree(HTML, tmp, ignore=shutil.ignore_patterns(".doctrees", ".buildinfo", "_sources", "*.ipynb", "*.map", "locales", "*webpack-macros.html"))
    (tmp / ".nojekyll").write_text("")  # GitHub Pages: serve _static/ and _images/ as they are
    # Sphinx's incremental build keeps every figure it ever wrote: ship only the ones a page still shows
    shown = {m for page in tmp.rglob("*.html") for m in re.findall(r'_images/([^"\'\s)]+)', page.read_text())}
    for img in (tmp / "_images").glob("*"):
        if img.name not in shown: img.unlink()
    (tmp / STAMP.name).write_text(inputs_hash() + "\n")
    if DOCS.exists(): shutil.rmtree(DOCS)
    tmp.rename(DOCS)
    (ROOT / "README.md").write_text(readme.render())
    size = sum(p.stat().st_size for p in DOCS.rglob("*") if p.is_file())
    print(f"built docs/ ({len(list(DOCS.rglob('*.html')))} pages, {size/1e6:.1f} MB) and README.md in {time.time()-t0:.0f} s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--if-stale", action="store_true", help="skip the build when docs/ was built from these exact inputs")
    ap.add_argument("-j", "--jobs", default="auto", help="Sphinx parallel jobs (default: auto)")
    a = ap.parse_args(argv)
    if a.if_stale and not is_stale():
        print("docs/ is up to date with nbs/, minfer/ and tools/ (delete docs/.build-inputs to force a build)")
        return 0
    build(a.jobs)
    return 0


if __name__ == "__main__": sys.exit(main())
