"""Numbers in a chapter's prose come from that chapter's outputs. A measured-looking number in a markdown cell (a number
with x, ms, µs, s, tok/s, GB/s, MB, GB, KB or %) must appear in the stored output of one of the same chapter's code
cells, so that the reader can see where it was printed. The numbers that do not yet are listed per chapter in
tests/prose_numbers.json, which may only shrink: a new unbacked number fails, and so does one listed there that is
gone (take it out of the list)."""
import json, re
from collections import Counter
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
KNOWN = ROOT / "tests" / "prose_numbers.json"
MEASURED = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s?(x|×|ms|µs|s|tok/s|tokens/s|GB/s|MB|GB|KB|%)(?![\w/])")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
CODE_SPAN = re.compile(r"`[^`]*`")  # a code span names a thing (`max_tokens=600`); it does not report a measurement


def shown_text(cell):
    "The text a code cell's stored outputs show: streams, and the text, markdown and HTML of its results."
    parts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            parts.append("".join(output["text"]))
        for kind in ("text/plain", "text/markdown", "text/html"):
            parts.append("".join(output.get("data", {}).get(kind, "")))
    return "\n".join(parts)


def unbacked_numbers(nb):
    "Measured-looking numbers in `nb`'s markdown that none of its code cells' outputs print, in order."
    shown = {n.replace(",", "") for c in nb.cells if c.cell_type == "code" for n in NUMBER.findall(shown_text(c))}
    found = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for m in MEASURED.finditer(CODE_SPAN.sub("", cell.source)):
            if m.group(1).replace(",", "") not in shown:
                found.append(m.group(0))
    return found


def chapter_unbacked():
    "{chapter: Counter of its unbacked numbers}, over every notebook in nbs/."
    return {p.stem: Counter(unbacked_numbers(nbformat.read(p, as_version=4)))
            for p in sorted((ROOT / "nbs").glob("*.ipynb"))}


def test_prose_numbers_come_from_their_chapter():
    found, known = chapter_unbacked(), json.loads(KNOWN.read_text())
    new = {ch: sorted((c - Counter(known.get(ch, []))).elements()) for ch, c in found.items()}
    new = {ch: n for ch, n in new.items() if n}
    assert not new, ("measured-looking numbers in prose that no output of their chapter prints (print them in a cell, "
                     f"or show the arithmetic in a code cell): {new}")
    gone = {ch: sorted((Counter(known[ch]) - found.get(ch, Counter())).elements()) for ch in known}
    gone = {ch: n for ch, n in gone.items() if n}
    assert not gone, f"fewer unbacked numbers than tests/prose_numbers.json lists (take these out): {gone}"


def test_the_number_check_can_fail():
    printed = nbformat.v4.new_code_cell("print(f'{41.5:.1f} tok/s')", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="41.5 tok/s\n")])
    nb = nbformat.v4.new_notebook(cells=[printed, nbformat.v4.new_markdown_cell(
        "Decode runs at 41.5 tok/s, 1.19x the default, with `max_tokens=600` and 128 tokens.")])
    assert unbacked_numbers(nb) == ["1.19x"]
