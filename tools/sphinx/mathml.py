"""Sphinx extension: render math to MathML at build time (latex2mathml), so pages need no MathJax and no network.

Every current browser renders MathML Core natively. Select it with `html_math_renderer = "mathml"`.
"""
from docutils import nodes
from latex2mathml.converter import convert


def visit_math(self, node):
    try: self.body.append(f'<span class="math notranslate">{convert(node.astext(), display="inline")}</span>')
    except Exception as e:
        from sphinx.util import logging
        logging.getLogger(__name__).warning(f"MathML could not render {node.astext()!r}: {e}", location=node)
        self.body.append(f'<code class="math">{self.encode(node.astext())}</code>')
    raise nodes.SkipNode


def visit_math_block(self, node):
    latex = node.astext()
    if node.get("number"): self.body.append(f'<span class="eqno">({node["number"]})</span>')
    try: html = convert(latex, display="block")
    except Exception as e:
        from sphinx.util import logging
        logging.getLogger(__name__).warning(f"MathML could not render {latex!r}: {e}", location=node)
        html = f"<pre>{self.encode(latex)}</pre>"
    self.body.append(f'<div class="math notranslate">{html}</div>\n')
    raise nodes.SkipNode


def setup(app):
    app.add_html_math_renderer("mathml", (visit_math, None), (visit_math_block, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
