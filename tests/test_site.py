"""The course site, tested as a reader sees it.

docs/ is served on a random free localhost port (stdlib http.server in a thread) and opened in headless Chromium
through selenium and Debian's chromedriver: every image on the landing page and the chapter pages must load, and the
browser console must show no errors (a failed script, stylesheet or image load is an error too, so the site must not
need the network). Every internal href/src of every page must resolve to a file, and its #fragment to an id there.
Screenshots go to _build/site/screenshots/.

Chromium: `bash tools/install_chromium.sh` (run by `make test`). Without it the browser tests skip, with the reason,
unless CI is set: in CI they fail.
"""
import functools, html.parser, json, http.server, os, re, shutil, sys, threading, time
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SHOTS = ROOT / "_build" / "site" / "screenshots"
sys.path.insert(0, str(ROOT / "tools"))
import build_docs, readme  # noqa: E402



@pytest.fixture(autouse=True)
def _built():
    if not (DOCS / "index.html").exists():
        msg = "docs/ is not built: run make docs (python tools/build_docs.py)"
        if os.environ.get("CI"): pytest.fail(msg + " — CI is set, so the site must be tested")
        pytest.skip(msg)

CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,900"]


# ---------------------------------------------------------------- static checks (no browser)
class _Refs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"): self.ids.add(a["id"])
        if tag == "a" and a.get("name"): self.ids.add(a["name"])
        for k in ("href", "src"):
            if a.get(k) is not None: self.refs.append((tag, k, a[k]))


@functools.lru_cache(None)
def _parse(path):
    p = _Refs()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def _pages(): return sorted(DOCS.rglob("*.html"))


def test_docs_are_current():
    "docs/ was built from the notebooks, modules and tools as they are now (`make test` rebuilds it when stale)."
    assert not build_docs.is_stale(), "docs/ is stale: run make docs (python tools/build_docs.py)"


def test_readme_is_rendered_from_index():
    assert (ROOT / "README.md").read_text() == readme.render(), "README.md is stale: run python tools/readme.py"


def test_code_fold_cells_fold_away(tmp_path):
    "A `#| code-fold: true` cell keeps its code and outputs behind a 'Show the code' toggle; other cells stay open."
    cells = [{"id": i, "cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": src}
             for i, src in (("f", "#| code-fold: true\nx = 1"), ("o", "y = 2"), ("n", "#| code-fold: false\nz = 3"))]
    nb_path = tmp_path / "t.ipynb"
    nb_path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    folded, plain_cell, unfolded = build_docs.process_notebook(nb_path, {}, {}).cells
    assert "hide-input" in folded.metadata["tags"] and folded.metadata["mystnb"]["code_prompt_show"] == "Show the code"
    assert folded.source.strip() == "x = 1"
    for c in (plain_cell, unfolded): assert "hide-input" not in c.metadata.get("tags", []) and "mystnb" not in c.metadata


def test_site_has_every_notebook_and_module():
    for nb in build_docs.notebooks():
        assert (DOCS / f"{nb.stem}.html").exists(), f"no page for {nb.name}"
    for mod in build_docs.module_names():
        assert (DOCS / "api" / f"{mod}.html").exists(), f"no API page for {mod}"
    for page in ("search.html", "searchindex.js", "instructor_guide.html", "api/index.html"):
        assert (DOCS / page).exists(), page


def test_no_broken_internal_links():
    "Every href/src of every page resolves to a file in docs/, and every #fragment to an id in that file."
    pages = _pages()
    assert len(pages) >= 5
    broken, checked = [], 0
    for page in pages:
        for tag, attr, ref in _parse(page).refs:
            url = urlparse(ref)
            if url.scheme or url.netloc or ref.startswith(("mailto:", "javascript:", "data:")): continue
            path, frag = urldefrag(ref)
            target = page if not path else (page.parent / unquote(path.split("?")[0])).resolve()
            if target.is_dir(): target = target / "index.html"
            checked += 1
            if not target.is_file() or not target.resolve().is_relative_to(DOCS.resolve()):
                broken.append(f"{page.relative_to(DOCS)}: <{tag} {attr}={ref!r}> -> missing file"); continue
            if frag and target.suffix == ".html" and unquote(frag) not in _parse(target).ids:
                broken.append(f"{page.relative_to(DOCS)}: <{tag} {attr}={ref!r}> -> no id {frag!r}")
    assert checked > 100
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken[:40])


def test_every_public_name_is_documented_and_linked_to_its_chapter():
    import importlib
    from docutils.nodes import make_id
    for mod in build_docs.module_names():
        page = DOCS / "api" / f"{mod}.html"
        ids, text = _parse(page).ids, page.read_text()
        for name in importlib.import_module(mod).__all__:
            full = f"{mod}.{name}"
            assert full in ids, f"{full} has no entry on {page.relative_to(DOCS)}"
        # each entry says where it is built: a link to an anchor in a chapter page (checked by the link test)
        for name in importlib.import_module(mod).__all__:
            anchor = make_id(build_docs.label(f"{mod}.{name}"))  # as docutils spells a label (`rope_` -> `...-rope`)
            assert f"#{anchor}\"" in text, f"{mod}.{name}: no link to the chapter cell that builds it"


def test_search_index_covers_the_chapters():
    idx = (DOCS / "searchindex.js").read_text()
    for nb in build_docs.notebooks():
        assert f'"{nb.stem}"' in idx, f"{nb.stem} is not in the search index"
    assert "bandwidth" in idx


# ---------------------------------------------------------------- in the browser
@pytest.fixture(scope="module")
def site():
    handler = functools.partial(type("Quiet", (http.server.SimpleHTTPRequestHandler,),
                                     {"log_message": lambda *a: None}), directory=str(DOCS))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown(); server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        msg = "headless Chromium and chromedriver are needed: bash tools/install_chromium.sh (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"): pytest.fail(msg + " — CI is set, so this must run")
        pytest.skip(msg)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for f in CHROME_FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]: opts.add_argument(f)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    d.set_page_load_timeout(30)
    yield d
    d.quit()


def _open(browser, url):
    browser.get(url)
    t = time.time()
    while browser.execute_script("return document.readyState") != "complete" and time.time() - t < 15: time.sleep(0.1)
    # scroll through the page so that any lazily loaded image is requested, then wait for all images to settle
    browser.execute_script("document.querySelectorAll('img').forEach(i => { i.loading = 'eager'; });"
                           "window.scrollTo(0, document.body.scrollHeight);")
    t = time.time()
    while not browser.execute_script("return [...document.images].every(i => i.complete)") and time.time() - t < 15:
        time.sleep(0.1)
    browser.execute_script("window.scrollTo(0, 0)")


def _browser_pages():
    chapters = [p.stem for p in build_docs.notebooks() if p.stem != "index"]
    return ["index"] + chapters + ["api/minfer.roofline", "instructor_guide"]


@pytest.mark.parametrize("page", _browser_pages())
def test_page_renders_with_images_and_no_console_errors(browser, site, page):
    browser.get_log("browser")  # drop entries from earlier pages
    _open(browser, f"{site}/{page}.html")
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / f"{page.replace('/', '_')}.png"))
    images = browser.execute_script(
        "return [...document.images].map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])")
    bad = [src for src, complete, width in images if not complete or width == 0]
    assert not bad, f"{page}: images that did not load: {bad}"
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"{page}: browser console errors:\n" + "\n".join(e["message"] for e in errors)
    assert browser.find_elements("css selector", "article h1"), f"{page}: no title heading rendered"
    assert "minfer" in browser.title


def test_chapter_figures_and_math_render(browser, site):
    "A chapter with stored figures shows them, and its formula is typeset (MathML, no script)."
    _open(browser, f"{site}/00b_roofline.html")
    widths = browser.execute_script("return [...document.querySelectorAll('article img')].map(i => i.naturalWidth)")
    assert len(widths) >= 2 and min(widths) > 100, f"expected the roofline figures, got widths {widths}"
    _open(browser, f"{site}/00a_model.html")
    box = browser.execute_script("const m = document.querySelector('math[display=block]');"
                                 "return m && m.getBoundingClientRect().height")
    assert box and box > 20, "the bandwidth formula is not rendered as block math"


def test_search_finds_a_chapter(browser, site):
    browser.get_log("browser")
    _open(browser, f"{site}/search.html?q=roofline")
    t, links = time.time(), []
    while time.time() - t < 15 and not links:
        links = browser.execute_script("return [...document.querySelectorAll('#search-results a')].map(a => a.href)")
        time.sleep(0.2)
    assert any("00b_roofline.html" in h for h in links), f"searching 'roofline' did not find chapter 00b: {links[:5]}"
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, "\n".join(e["message"] for e in errors)
