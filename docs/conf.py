"""Sphinx configuration of the keras-ring docs: Markdown pages and tutorial notebooks (MyST-NB),
and an API reference generated from the docstrings of the installed package."""

project = "keras-ring"
author = "keras-ring developers"
# myst_nb reads Markdown (it brings myst_parser) and notebooks.
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
# The notebooks are shown as stored; the test suite executes them
# (tests/test_tutorials.py), so the docs build stays fast.
nb_execution_mode = "off"
# Worker output arrives line by line; show each cell's output as one block.
nb_merge_streams = True
html_theme = "alabaster"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
myst_heading_anchors = 3

import re  # noqa: E402

# The docstrings are written as Keras writes its own: Markdown code fences and
# single backticks. Turn those into reStructuredText before napoleon reads them.
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_INLINE = re.compile(r"(?<![`\w])`([^`]+)`(?![`\w])")


def _markdown_to_rst(app, what, name, obj, options, lines):
    out, fence_indent = [], None
    for line in lines:
        fence = _FENCE.match(line)
        if fence and fence_indent is None:
            fence_indent = fence[1]
            out += [f"{fence_indent}.. code-block:: {fence[2] or 'text'}", ""]
        elif fence:
            fence_indent = None
            out.append("")
        elif fence_indent is not None:
            out.append(f"{fence_indent}   {line[len(fence_indent) :]}" if line.strip() else "")
        else:
            out.append(_INLINE.sub(r"``\1``", line))
    lines[:] = out


def setup(app):
    app.connect("autodoc-process-docstring", _markdown_to_rst, priority=400)
