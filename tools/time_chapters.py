"""Measure how long each chapter notebook takes to run, for the instructor guide; writes tools/chapter_times.json.

    python tools/time_chapters.py                  # every nbs/*.ipynb except index, one at a time
    python tools/time_chapters.py nbs/00a_model.ipynb ...

Each notebook runs alone under `nbdev-test` (a fresh process: imports included, cells flagged notest/gpu/slow
skipped), as `make test` runs it; the wall-clock time is recorded with a hash of the notebook's code, so the guide can
say when a chapter changed after it was timed. Measure on an otherwise idle machine: other work on the cores inflates it.
"""
from __future__ import annotations

import datetime, json, os, platform, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from build_docs import TIMES, code_hash, notebooks  # noqa: E402


def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return f"{os.cpu_count()} cores, {cpu}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    paths = [Path(a).resolve() for a in argv] or [p for p in notebooks() if p.stem != "index"]
    data = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    data.setdefault("chapters", {})
    nbdev_test = Path(sys.executable).with_name("nbdev-test")
    for p in paths:
        t = time.perf_counter()
        r = subprocess.run([str(nbdev_test), str(p), "--n-workers", "0"], cwd=ROOT, capture_output=True, text=True)
        dt = time.perf_counter() - t
        if r.returncode != 0:
            print(f"{p.name}: FAILED under nbdev-test ({dt:.0f} s); not recorded\n{r.stderr[-2000:]}")
            continue
        load = round(os.getloadavg()[0], 1)  # over the last minute: above the core count, the machine was shared
        data["chapters"][p.name] = {"seconds": round(dt, 1), "code_hash": code_hash(p), "load": load}
        print(f"{p.name:32s} {dt:6.1f} s   (load average {load} on {os.cpu_count()} cores)")
    data["machine"], data["cores"] = machine(), os.cpu_count()
    data.pop("note", None)  # a note about an earlier measurement no longer applies
    data["measured"] = datetime.date.today().isoformat()
    data["command"] = "python tools/time_chapters.py (nbdev-test, one notebook at a time, wall clock)"
    data["chapters"] = dict(sorted(data["chapters"].items()))
    TIMES.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {TIMES.relative_to(ROOT)}")
    return 0


if __name__ == "__main__": sys.exit(main())
