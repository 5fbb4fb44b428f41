"""Every file a README/docs page names exists in the repository, and none names DESIGN.md (the
design notes are not part of the repository)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:docs|bench|tests|scripts|examples|dtenjax|csrc|custom_calls|"
                  r"\.ci)/[\w./+*-]*[\w*])")


def _references(text: str) -> set[str]:
  found = set()
  for m in PATH.finditer(text):
    ref = m.group(1)
    if any(c in ref for c in "*{}<>") or re.search(r"/[A-Z_]+(\.|$)", ref):
      continue            # globs and placeholders (bench/NAME.py)
    found.add(ref.rstrip("."))
  return found


def test_every_referenced_path_exists():
  missing = {}
  for page in PAGES:
    for ref in _references(page.read_text(encoding="utf-8")):
      if not (ROOT / ref).exists():
        missing.setdefault(page.name, []).append(ref)
  assert not missing, missing


def test_the_check_sees_references():
  refs = _references("see docs/planner.md, bench/NAME.py and `dtenjax/_src/topology/detect.py`.")
  assert refs == {"docs/planner.md", "dtenjax/_src/topology/detect.py"}
  assert (ROOT / "docs" / "planner.md").exists()


def test_no_page_or_module_names_design_md():
  files = PAGES + sorted((ROOT / "dtenjax").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
  named = [str(p.relative_to(ROOT)) for p in files if "DESIGN.md" in p.read_text(encoding="utf-8")]
  assert not named, named


def test_every_image_a_page_shows_exists_and_is_small():
  """Markdown images (![alt](path), relative to the page) are committed PNG/SVG files, each
  small enough for the repository (charts, not screenshots)."""
  shown = 0
  for page in PAGES:
    for alt, ref in re.findall(r"!\[([^\]]*)\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
      path = (page.parent / ref).resolve()
      assert alt.strip(), (page.name, ref, "an image needs alt text")
      assert path.is_file() and path.suffix in (".png", ".svg"), (page.name, ref)
      assert path.stat().st_size < 200_000, (page.name, ref, path.stat().st_size)
      shown += 1
  assert shown >= 4            # docs/benchmarks.md's charts


def test_the_readme_api_table_names_every_public_name():
  """README's "Public API" table is the index a reader scans: every name of ``dtenjax.__all__``
  is in it (the API reference, docs/api, documents each)."""
  import dtenjax
  text = (ROOT / "README.md").read_text()
  table = text[text.index("## Public API"):]
  table = table[:table.index("\n## ")]
  missing = [n for n in dtenjax.__all__ if not re.search(rf"\b{n}\b", table)]
  assert not missing, f"add these to README's Public API table: {missing}"


FENCE_LINE = re.compile(r"^[ \t]*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
ANCHOR_LINK = re.compile(r"\]\(([\w./-]*\.md)?#([^)\s]+)\)")


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: its text as rendered (inline code and link text kept, markup
  dropped), lower case, without characters other than letters, digits, `_`, `-` and spaces, and
  each space a `-`."""
  text = re.sub(r"`([^`]*)`", r"\1", heading)
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
  text = re.sub(r"<[^>]*>", "", text).lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
  """The anchors of a page's headings (outside code fences); a repeated one gets -1, -2, ..."""
  anchors, inside = set(), False
  for line in text.splitlines():
    if FENCE_LINE.match(line):
      inside = not inside
      continue
    m = None if inside else HEADING.match(line)
    if m:
      slug, n = _slug(m.group(2)), 0
      while (slug if n == 0 else f"{slug}-{n}") in anchors:
        n += 1
      anchors.add(slug if n == 0 else f"{slug}-{n}")
  return anchors


def test_anchors_follow_githubs_rules():
  text = ("# Measured results\n## The loss's vocabulary chain in XLA:CPU's heap (issue 39, item 3)\n"
          "```text\n## not a heading\n```\n## `dtenjax.tensor`'s memory, again\n### bytes4\n"
          "### bytes4\n## Planning time, eighth round (#39)\n")
  assert _anchors(text) == {"measured-results",
                            "the-losss-vocabulary-chain-in-xlacpus-heap-issue-39-item-3",
                            "dtenjaxtensors-memory-again", "bytes4", "bytes4-1",
                            "planning-time-eighth-round-39"}


def test_every_anchor_link_names_a_heading():
  """Every `[text](#anchor)` and `[text](page.md#anchor)` link of README.md and docs/*.md names
  a heading of that page (GitHub's anchors; a heading repeated in a page gets -1, -2, ...)."""
  broken, seen = {}, 0
  for page in PAGES:
    for target, anchor in ANCHOR_LINK.findall(page.read_text(encoding="utf-8")):
      linked = (page.parent / target).resolve() if target else page
      seen += 1
      if not linked.is_file() or anchor not in _anchors(linked.read_text(encoding="utf-8")):
        broken.setdefault(page.name, []).append(f"{target}#{anchor}")
  assert not broken, broken
  assert seen >= 1              # docs/transport.md's link to its verbs section


def test_every_code_fence_is_closed():
  """A fence left open turns the rest of its page into code: its headings lose their anchors and
  its prose renders as text (docs/benchmarks.md's wire17 section did, unseen for a round)."""
  open_at = {}
  for page in PAGES:
    start = None
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
      if FENCE_LINE.match(line):
        start = n if start is None else None
    if start is not None:
      open_at[page.name] = start
  assert not open_at, open_at
