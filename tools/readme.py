"""Render README.md from nbs/index.ipynb (the landing page of the course site is the same notebook).

    python tools/readme.py           # write README.md
    python tools/readme.py --check   # exit 1 if README.md is not what index.ipynb renders to

Markdown cells are copied; code cells are shown as Python blocks with their text outputs; cells marked `#| hide` are
left out; directives (`#| ...`) are stripped. Chapter lines (`- **01 · Title**: ...`) become links to the chapter's
notebook when `nbs/01_*.ipynb` exists, so the list never links to a chapter that is not written yet.
"""
from __future__ import annotations

import argparse, re, sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT / "nbs"
_CHAPTER = re.compile(r"^(\s*[-*]\s+)\*\*(\d\d[a-z]?) · (.+?)\*\*", re.MULTILINE)
_DIRECTIVE = re.compile(r"^\s*#\|\s*(\S+)(.*)$")


def directives(source: str) -> dict:
    "The `#| name value` lines at the top of a code cell."
    d = {}
    for line in source.splitlines():
        if not line.strip(): continue
        m = _DIRECTIVE.match(line)
        if not m: break
        d[m.group(1).rstrip(":")] = m.group(2).strip()
    return d


def strip_directives(source: str) -> str:
    lines = source.splitlines()
    while lines and (not lines[0].strip() or _DIRECTIVE.match(lines[0])): lines.pop(0)
    return "\n".join(lines)


def chapter_notebook(number: str, nbs: Path = NBS):
    "The notebook of chapter `number` ('00a', '01', ...), or None if it is not written yet."
    found = sorted(nbs.glob(f"{number}_*.ipynb"))
    return found[0] if found else None


def link_chapters(md: str, prefix: str = "", nbs: Path = NBS) -> str:
    "Link each `**NN · Title**` list item to its notebook (`prefix` + file name) where that notebook exists."
    def sub(m):
        nb = chapter_notebook(m.group(2), nbs)
        if nb is None: return m.group(0)
        return f"{m.group(1)}[**{m.group(2)} · {m.group(3)}**]({prefix}{nb.name})"
    return _CHAPTER.sub(sub, md)


def render(nb_path: Path = NBS / "index.ipynb") -> str:
    nb = nbformat.read(nb_path, as_version=4)
    parts = [f"<!-- generated from {nb_path.relative_to(ROOT).as_posix() if nb_path.is_relative_to(ROOT) else nb_path.name} "
             "by tools/readme.py: edit the notebook, then run `python tools/readme.py` -->"]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            parts.append(link_chapters(cell.source.strip(), "nbs/", nb_path.parent))
        elif cell.cell_type == "code":
            d = directives(cell.source)
            if "hide" in d or d.get("include") == "false": continue
            src = strip_directives(cell.source).strip()
            if src and "hide_input" not in d: parts.append(f"```python\n{src}\n```")
            for o in cell.get("outputs", []):
                text = o.get("text") if o.output_type == "stream" else o.get("data", {}).get("text/plain")
                if text: parts.append("```\n" + (text if isinstance(text, str) else "".join(text)).rstrip() + "\n```")
    return "\n\n".join(p for p in parts if p) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if README.md is out of date")
    a = ap.parse_args(argv)
    text, readme = render(), ROOT / "README.md"
    if a.check:
        if not readme.exists() or readme.read_text() != text:
            print("README.md is out of date with nbs/index.ipynb: run python tools/readme.py"); return 1
        print("README.md is up to date"); return 0
    readme.write_text(text)
    print(f"wrote {readme.relative_to(ROOT)} from nbs/index.ipynb")
    return 0


if __name__ == "__main__": sys.exit(main())
