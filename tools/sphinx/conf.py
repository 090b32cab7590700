# Sphinx configuration of the minfer course site. tools/build_docs.py copies this file into the generated source
# folder (_build/site/src) next to the processed notebooks, the API pages and `_symbols.json`; do not run
# sphinx-build on nbs/ directly.
import inspect, json, re, sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
SYMBOLS = json.loads((HERE / "_symbols.json").read_text())  # "minfer.model.RMSNorm" -> {label, chapter, title}

project = "minfer"
author = "minfer developers"
copyright = "minfer developers, Apache-2.0"
extensions = ["myst_nb", "sphinx.ext.autodoc", "mathml"]

# notebooks are shown with their stored outputs: the build never runs them
nb_execution_mode = "off"
nb_merge_streams = True
nb_output_stderr = "remove"  # library warnings (e.g. transformers) are noise on a course page
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "attrs_inline"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# every warning fails the build (tools/build_docs.py passes -W); unresolved references to minfer objects are
# warnings too, while references to torch, numpy, builtins... (no network for intersphinx) are left as plain text
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!minfer(\.|$)).*")]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autoclass_content = "both"

html_theme = "sphinx_book_theme"
html_title = "minfer"
html_math_renderer = "mathml"  # MathML at build time: no MathJax, no CDN, works offline
html_static_path = ["_static"]
html_css_files = ["minfer.css"]
html_favicon = "_static/favicon.svg"
html_copy_source = False       # the notebooks are in the repository; no second copy in the site
html_show_sourcelink = False
html_last_updated_fmt = None
html_context = {"default_mode": "auto"}  # light or dark as the reader's system prefers (and no console error)
html_theme_options = {
    "repository_url": "https://github.com/minfer/minfer",
    "path_to_docs": "nbs",
    "use_repository_button": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
exclude_patterns = ["_ext", "_symbols.json", "**.ipynb_checkpoints"]


_SHORT = {}
for _full in SYMBOLS:
    _SHORT.setdefault(_full.rsplit(".", 1)[1], []).append(_full)


def _link_code(html, module):
    "`<code>Name</code>` of a public minfer name -> a link to its entry (all API pages live side by side in api/)."
    def sub(m):
        fulls = _SHORT.get(m.group(1), [])
        full = next((f for f in fulls if f.startswith(module + ".")), fulls[0] if len(fulls) == 1 else None)
        if not full: return m.group(0)
        return f'<a class="reference internal" href="{full.rsplit(".", 1)[0]}.html#{full}">{m.group(0)}</a>'
    return re.sub(r"<code>([A-Za-z_]\w*)</code>", sub, html)


def _docstring(app, what, name, obj, options, lines):
    """nbdev docstrings are Markdown, not reStructuredText: render them with markdown-it (as MyST does) instead of
    letting docutils misread lists and backticks; link names of minfer objects; add where each name is built."""
    if what == "module":  # nbdev puts "Docs: <nbdev site>" in module docstrings: this site is the docs
        lines[:] = [l for l in lines if not l.startswith("Docs: ")]
    if what in ("data", "attribute") and obj is not None and not callable(obj):
        # a plain value has no docstring of its own: autodoc would show its type's (dict's, str's...)
        if "\n".join(lines).strip() == (inspect.getdoc(type(obj)) or "").strip(): lines[:] = []
    md = "\n".join(lines).strip()
    if md:
        from markdown_it import MarkdownIt
        module = name if what == "module" else next((m for m in sorted({f.rsplit(".", 1)[0] for f in SYMBOLS}, key=len, reverse=True)
                                                      if name.startswith(m + ".")), "")
        html = _link_code(MarkdownIt("commonmark").enable("table").render(md), module)
        # in a container: a raw node cannot carry the ids (e.g. the module's target) that docutils moves onto it
        lines[:] = [".. container:: minfer-docstring", "", "   .. raw:: html", ""] + ["      " + l for l in html.splitlines()] + [""]
    sym = SYMBOLS.get(name)
    if sym:
        lines += ["", f"*Built in* :ref:`{sym['title']} <{sym['label']}>`", ""]


def setup(app):
    app.connect("autodoc-process-docstring", _docstring)
