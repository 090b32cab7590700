"""The scoreboard (chapter 00b's `Scoreboard`, data in benchmarks/scoreboard.json): every point is copied from a record
in benchmarks/ or a chapter's stored output that exists and holds its numbers, every chapter has a point or says why
not, every chapter shows the board, the figure draws, and a bad point is refused in one line."""
import json, re
from pathlib import Path
import pytest
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from minfer.roofline import Scoreboard, ScorePoint, scoreboard_path

ROOT = Path(__file__).resolve().parent.parent
DATA = json.loads((ROOT / "benchmarks" / "scoreboard.json").read_text())
CHAPTERS = sorted(p.name.split("_")[0] for p in (ROOT / "nbs").glob("[0-9][0-9]*_*.ipynb"))
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def source_text(path):
    "A record's text, or a notebook's sources and stored text outputs."
    text = (ROOT / path).read_text()
    if not path.endswith(".ipynb"): return text
    parts = []
    for cell in json.loads(text)["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def test_the_data_parses_and_every_point_names_an_existing_source():
    board = Scoreboard.load()
    assert scoreboard_path() == ROOT / "benchmarks" / "scoreboard.json"
    assert len(board.points) == len(DATA["points"]) >= 10
    for p in board.points:
        assert (ROOT / p.source).is_file(), f"{p.chapter} {p.technique}: no file {p.source}"
        assert p.chapter in CHAPTERS, f"{p.chapter}: no notebook nbs/{p.chapter}_*.ipynb"
    for key, m in board.machines.items():
        assert m["source"] is None or (ROOT / m["source"]).is_file(), key


def derived_rates(p):
    "Tokens/s that follow from what was timed: 1000 / (X ms) per row or per batch, N tokens / (X s)."
    rates = [k * 1e3 / float(ms) for ms in re.findall(r"(\d+(?:\.\d+)?) ms", p.measured) for k in (1, p.batch)]
    return rates + [int(n) / float(s) for n, s in re.findall(r"(\d+) [\w ]*tokens in (\d+(?:\.\d+)?) s", p.measured)]


def test_every_number_is_in_its_source():
    "What was timed, in the source's words, is in the source; the tok/s is too, or follows from those words."
    for p in Scoreboard.load().points:
        text, said = source_text(p.source), NUMBER.findall(p.measured)
        missing = [n for n in said if n not in text]
        assert not missing, f"{p.chapter} {p.technique}: {missing} not in {p.source}"
        derived = any(abs(rate - p.tok_s) < 0.051 for rate in derived_rates(p))
        assert f"{p.tok_s:.1f}" in text or derived, \
            f"{p.chapter} {p.technique}: {p.tok_s} tok/s neither in {p.source} nor from {p.measured!r}"
    for key, m in DATA["machines"].items():
        if m["bandwidth_gbs"]: assert f"{m['bandwidth_gbs']}" in source_text(m["source"]), key


def test_every_chapter_has_a_point_or_says_why_not():
    with_points = {p["chapter"] for p in DATA["points"]}
    assert not with_points & set(DATA["no_point"]), "a chapter both has points and says it has none"
    assert set(CHAPTERS) == with_points | set(DATA["no_point"]), set(CHAPTERS) ^ (with_points | set(DATA["no_point"]))


def test_every_chapter_from_00b_shows_the_board_with_its_own_points():
    for chapter in CHAPTERS:
        if chapter < "00b": continue
        nb = next((ROOT / "nbs").glob(f"{chapter}_*.ipynb"))
        code = ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        upto = "01" if chapter == "00b" else chapter  # 00b starts the board with chapter 01's naive decode
        assert any(f'.show(upto="{upto}")' in c for c in code), f"{nb.name} does not show the scoreboard up to {upto}"


def drawn_points(ax):
    "(MB/token, tok/s) of every point the figure's scatter collections hold."
    return [tuple(xy) for c in ax.collections for xy in c.get_offsets()]


def test_the_course_machine_is_one_of_the_machines():
    board = Scoreboard.load()
    assert DATA["course_machine"] in DATA["machines"] and board.course_machine == DATA["course_machine"]
    assert any(p.machine == board.course_machine for p in board.points)
    with pytest.raises(ValueError, match="course machine 'laptop'"):
        Scoreboard(DATA["machines"], course_machine="laptop")


def test_the_figure_draws_the_course_machines_points_up_to_a_chapter():
    board = Scoreboard.load()
    course = board.course_machine
    for upto in ("01", "05c", None):
        mine = [p for p in board.upto(upto) if p.machine == course]
        ax = board.show(upto)
        drawn, labels = drawn_points(ax), [c.get_label() for c in ax.collections]
        plt.close(ax.figure)
        assert sorted(drawn) == sorted((p.mb_per_token, p.tok_s) for p in mine), (upto, drawn)
        assert not any("other machines" in label for label in labels), labels
    assert board.report("03")[0].startswith("chapter 03: no point; ")


def test_overlays_draw_the_other_machines_faded_and_labelled():
    board = Scoreboard.load()
    for upto in ("01", "05c", None):
        ax = board.show(upto, overlays=True)
        drawn, collections = drawn_points(ax), list(ax.collections)
        plt.close(ax.figure)
        assert sorted(drawn) == sorted((p.mb_per_token, p.tok_s) for p in board.upto(upto)), upto
        overlays = [c for c in collections if c.get_label().startswith("other machines (records in benchmarks/)")]
        others = {p.machine for p in board.upto(upto)} - {board.course_machine}
        assert len(overlays) == len(others) and all(c.get_alpha() < 1 for c in overlays), upto
        for key in others:
            assert any(board.machines[key]["short"] in c.get_label() for c in overlays), key


def test_the_report_puts_the_course_machine_first_and_counts_the_others():
    board = Scoreboard.load()
    name = board.machines[board.course_machine]["name"]
    lines = board.report("13")  # chapter 13: two points on the course machine, one from a record of another
    course = [p for p in board.points if p.chapter == "13" and p.machine == board.course_machine]
    others = [p for p in board.points if p.chapter == "13" and p.machine != board.course_machine]
    assert course and others, "chapter 13 no longer has points on both the course machine and another"
    assert all(name in line for line in lines[:len(course)]), lines
    count = lines[len(course)]
    assert f"{len(others)} of chapter 13's " in count and "other machines" in count, lines
    assert all(line.startswith("  ") for line in lines[len(course) + 1:]) and len(lines) == len(course) + 1 + len(others)
    only_others = board.report("05b")  # chapter 05b: records of other machines only
    assert only_others[0].startswith("chapter 05b: no point on the course machine"), only_others


GOOD = dict(chapter="05c", technique="test", machine="epyc-avx2", dtype="float32", batch=1, tok_s=30.0,
            mb_per_token=538.1, source="benchmarks/decode-2026-11-22-0110.md")


@pytest.mark.parametrize("bad, says", [
    (dict(tok_s=-3.0), "tok_s must be > 0"), (dict(machine="laptop"), "machine 'laptop' is unknown"),
    (dict(batch=0), "batch must be an integer"), (dict(chapter="5c"), "chapter must look like"),
    (dict(source="/tmp/made-up.md"), "must name a record"), (dict(dtype="fp33"), "dtype 'fp33'"),
    (dict(speed=3), "unexpected keyword")])
def test_a_bad_point_is_refused_in_one_line(bad, says):
    board = Scoreboard.load()
    n = len(board.points)
    board.add(ScorePoint(**GOOD))  # the good one goes in
    with pytest.raises(ValueError) as e: board.add({**GOOD, **bad})
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert len(board.points) == n + 1


def test_the_report_uses_the_roof_the_plot_draws():
    """A point's ceiling is the lower of its machine's roofs: a batched point at 3 MB per token on the AVX-512 EPYC is
    bounded by its fp32 matmul rate / FLOPs per token (192 GFLOP/s / 0.269 GFLOP = 714 tok/s), not by its bandwidth
    (51.7 GB/s / 3 MB = 17233 tok/s); a batch-1 point by its bandwidth."""
    board = Scoreboard.load()
    machine = board.machines["epyc-avx512"]
    compute = machine["fp32_gflops"] / board.gflops_per_token
    batched = board.add({**GOOD, "technique": "batched", "machine": "epyc-avx512", "batch": 64, "tok_s": 187.5,
                         "mb_per_token": 3.0})
    assert board.ceiling(batched) == (pytest.approx(compute), "fp32 matmul")
    one_row = board.add({**GOOD, "technique": "one row", "machine": "epyc-avx512"})
    assert board.ceiling(one_row) == (pytest.approx(51.7e3 / 538.1), "copy bandwidth")
    line = next(line for line in board.report("05c") if " batched " in line)
    assert f"{187.5 / compute:.0%} of its ceiling ({compute:.0f} tok/s, fp32 matmul)" in line, line


def test_a_point_above_its_ceiling_is_kept_and_said():
    "33.3 GB/s / 538.1 MB = 61.9 tok/s on the AVX2 EPYC: a point at 80 is drawn, and its line says it is above."
    board = Scoreboard.load()
    above = board.add({**GOOD, "technique": "above", "tok_s": 80.0})
    assert above in board.points
    line = next(line for line in board.report("05c") if " above (" in line)
    assert "129% of its ceiling (62 tok/s, copy bandwidth): above it" in line, line


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no scoreboard at"): Scoreboard.load(tmp_path / "none.json")


GPU_RECORD = re.compile(r"benchmarks/[\w.-]*[hH][12]00[\w.-]*\.md")  # an H100's or an H200's


def gpu_gaps(nb_path):
    """What a chapter's GPU claims lack: GPU cells (`#| gpu`, never run without one) not followed by a code cell that
    reads a recorded GPU run, and GPU records its prose cites that no code cell reads."""
    cells = json.loads(Path(nb_path).read_text())["cells"]
    code = [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    gaps, gpu = [], [i for i, s in code if s.startswith("#| gpu")]
    if gpu:
        after = next((s for i, s in code if i > gpu[-1]), "")
        if after.startswith("#| gpu") or not GPU_RECORD.search(after):
            gaps.append(f"no cell after the GPU cell {gpu[-1]} reads a recorded GPU run")
    cited = {m for c in cells if c["cell_type"] == "markdown" for m in GPU_RECORD.findall("".join(c["source"]))}
    gaps += [f"{r} is cited but no cell reads it" for r in sorted(cited) if not any(r in s for _, s in code)]
    return gaps


def test_gpu_claims_show_their_recorded_runs():
    gaps = {nb.name: g for nb in sorted((ROOT / "nbs").glob("*.ipynb")) if (g := gpu_gaps(nb))}
    assert not gaps, gaps
    for record in {m for nb in (ROOT / "nbs").glob("*.ipynb") for m in GPU_RECORD.findall(nb.read_text())}:
        assert (ROOT / record).is_file(), record


def test_the_gpu_check_can_fail(tmp_path):
    def nb(*cells):
        path = tmp_path / "x.ipynb"
        path.write_text(json.dumps({"cells": [{"cell_type": k, "source": [s]} for k, s in cells]}))
        return gpu_gaps(path)
    assert nb(("code", "#| gpu\nrun()"), ("markdown", "prose"))
    assert nb(("code", "#| gpu\nrun()"), ("code", "print('no record')"))
    assert nb(("markdown", "see benchmarks/x-h100.md"), ("code", "pass"))
    assert not nb(("code", "#| gpu\nrun()"), ("code", "open('../benchmarks/x-H100.md')"))


def test_the_benchmarks_index_lists_every_record_and_script():
    "benchmarks/README.md is where run history lives: every record and bench script is in it, and nothing missing is."
    index = (ROOT / "benchmarks" / "README.md").read_text()
    files = [f.name for f in (ROOT / "benchmarks").iterdir()
             if f.suffix in (".md", ".json", ".py") and f.name != "README.md"]
    named = set(re.findall(r"`([\w.-]+\.(?:md|json|py))`", index))
    # a record's .json twin is listed as `, `.json`` beside its .md
    for pair in re.findall(r"`([\w.-]+)\.md`, `\.json`", index): named.add(pair + ".json")
    missing = sorted(f for f in files if f not in named)
    assert not missing, f"benchmarks/README.md does not list {missing}"
    gone = sorted(n for n in named if "/" not in n and not (ROOT / "benchmarks" / n).exists()
                  and not (ROOT / "kernels" / n).exists())
    assert not gone, f"benchmarks/README.md lists files that do not exist: {gone}"


def test_the_index_names_the_course_machine_once():
    "The landing page says which machine the course is measured on, in the scoreboard's words, once."
    cells = json.loads((ROOT / "nbs" / "index.ipynb").read_text())["cells"]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    name = DATA["machines"][DATA["course_machine"]]["name"]
    assert prose.count(name) == 1, f"the index names the course machine ({name}) {prose.count(name)} times"
    others = [m["name"] for key, m in DATA["machines"].items() if key != DATA["course_machine"]]
    assert not [n for n in others if n in prose], "the index names another machine as if it were the course's"


def test_the_bandwidth_measures_count_the_bytes_they_move(monkeypatch):
    "The ceiling's two bandwidths: a copy moves each byte twice (read, write), a read-only stream once."
    import minfer.roofline as roofline
    monkeypatch.setattr(roofline, "_median_time", lambda fn, **kw: (fn(), 1.0)[1])  # every timing: one second
    assert roofline.measure_bandwidth(nbytes=2**20) == 2 * 2**20
    assert roofline.measure_read_bandwidth(nbytes=2**20) == 2**20
