"""Sphinx configuration for the mogo documentation."""

import mogo

project = "mogo"
author = "mogo developers"
release = mogo.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax", "sphinx.ext.viewcode"]
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
nitpicky = True
# No network at build time, hence no intersphinx: references into other projects stay plain text.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|dist|np|numpy|collections\.abc|os|pathlib|argparse|contextlib)\..*"),
    (r"py:.*", r"(diffusers|transformers|accelerate|peft|PIL|matplotlib)\..*"),
    (r"py:class", r"(Tensor|Method|Normalization|GradMode|NonFinitePolicy|Accelerator)"),
    (r"py:class", r"mogo_diffusion\.rewards\.registry\.F"),  # a TypeVar
]
exclude_patterns = ["_build", "_generated"]
html_theme = "alabaster"
