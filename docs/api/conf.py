"""Sphinx configuration of the API reference (docs/api): autodoc reads the docstrings of the
public names, napoleon their Google-style sections. Build it with
``python -m sphinx -W -b html docs/api build/api`` (tests/test_api_reference.py does, warnings
as errors)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dtenjax  # noqa: E402

project = "dtenjax"
author = "dtenjax developers"
copyright = "dtenjax developers"
release = version = dtenjax.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Cross references to JAX, numpy and optax types in docstrings are not linked (no network at
# build time): names outside dtenjax stay plain text rather than warnings.
nitpicky = False
html_theme = "alabaster"
html_static_path = []
exclude_patterns = []
suppress_warnings = []
