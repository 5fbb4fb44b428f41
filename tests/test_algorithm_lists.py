"""Every hand-written list of dtenjax's algorithms (README, docs, docstrings) names exactly what
the registry (collectives/algorithms/registry.py) has, and the benchmarks' lists of candidates are
generated from it. A new algorithm is one file plus one registry line; this test names every
list that then falls behind, and finds lists it was not told about."""

import pathlib
import re
import sys

import pytest

from dtenjax._src.collectives.algorithms import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILIES = set(registry.FAMILIES)
RECORDS = {a.name for a in registry.REGISTRY}
REDUCE_SCATTER = {a.family for a in registry.REGISTRY if a.reduce_scatter is not None}

# (file, where the list starts, where it ends, what it must name). The names are the quoted ones
# ("x", `x`, ``x``) between the two markers, "auto" aside; "records" reads a table's first column.
LISTS = (
    ("README.md", r'algorithm="auto"\\\|', r"\(or a registry record name\)", FAMILIES),
    ("docs/collectives.md", r"`algorithm=` accepts `\"auto\"`, a family \(", r": the first record",
     FAMILIES),
    ("docs/collectives.md", r"\| record \| family \|", r"\n\n", RECORDS),
    ("dtenjax/_src/collectives/all_reduce.py", r"algorithm: \"auto\" \(cost model",
     r"-- or a registry", FAMILIES),
    ("dtenjax/_src/collectives/reduce_scatter.py", r"  Algorithms: \"ring\"", r"\"auto\"\.",
     REDUCE_SCATTER),
)
# Lines that name several algorithms without claiming to name them all, and why.
SUBSETS = {
    ("dtenjax/_src/collectives/buckets.py", "Bits: with ``one_shot``"):
        "the algorithms whose bits bucketing keeps",
    ("docs/reproducibility.md", "for any `bucket_bytes` (one_shot, two_shot, hierarchical"):
        "the same subset, in the docs",
    ("docs/collectives.md", "--candidates psum,auto,xla,one_shot,two_shot,ring,hierarchical"):
        "the command line of a recorded run",
    ("docs/benchmarks.md", "| eager | xla / ring / one_shot / two_shot / butterfly |"):
        "the algorithms one recorded eager run measured",
    ("docs/benchmarks.md", "| collectives on CPU against `lax.psum` |"):
        "the algorithms of the newest compile-time runs, in the Current results table",
    ("docs/collectives.md", "the rank-order folds of two_shot, one_shot and hierarchical"):
        "the algorithms whose per-element work is a custom call on XLA:CPU",
    ("docs/collectives.md", "| XLA:CPU, mesh axes of one process, extension built"):
        "the kernels each algorithm compiles there, one table cell",
    ("docs/collectives.md", "all-reduce (xla, ring, butterfly, hierarchical) run `reproducible=True`"):
        "the algorithms that run reproducible=True as the word exchange",
}
_QUOTED = re.compile(r'``([A-Za-z_]\w*)``|`([A-Za-z_]\w*)`|"([A-Za-z_]\w*)"')
_NAME = re.compile(r"\b(?:%s)\b" % "|".join(sorted(FAMILIES)))


def _bounds(path: str, start: str, end: str) -> tuple[int, int]:
  text = (ROOT / path).read_text()
  m = re.search(start, text)
  assert m, f"{path}: the list starting at /{start}/ is gone; update LISTS in {__file__}"
  e = re.compile(end).search(text, m.end())
  assert e, f"{path}: the list starting at /{start}/ has no end /{end}/"
  return m.start(), e.start()


def _span(path: str, start: str, end: str) -> str:
  a, b = _bounds(path, start, end)
  return (ROOT / path).read_text()[a:b]


def _names(span: str, expected: set[str]) -> set[str]:
  if expected is RECORDS:   # a markdown table: the record is the first cell of each row
    return {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", span, re.M)}
  return {next(g for g in m.groups() if g) for m in _QUOTED.finditer(span)} - {"auto"}


@pytest.mark.parametrize("path,start,end,expected", LISTS, ids=[f"{p}:{s[:24]}"
                                                                for p, s, _, _ in LISTS])
def test_hand_written_lists_name_every_algorithm(path, start, end, expected):
  names = _names(_span(path, start, end), expected)
  assert names == expected, (f"{path}: the list at /{start}/ names {sorted(names)}; the registry "
                             f"has {sorted(expected)} (missing {sorted(expected - names)}, "
                             f"unknown {sorted(names - expected)})")


def _sources():
  for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "dtenjax").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py")),
            *sorted((ROOT / "examples").rglob("*.py"))]:
    yield p.relative_to(ROOT).as_posix(), p.read_text()


def test_every_list_of_algorithms_is_one_this_test_checks():
  """A line naming four or more algorithms is a list: checked above, or a subset said to be one."""
  covered = {}
  for path, start, end, _ in LISTS:
    covered.setdefault(path, []).append(_bounds(path, start, end))
  unknown = []
  for path, text in _sources():
    offset = 0
    for n, line in enumerate(text.splitlines(keepends=True), 1):
      lo, offset = offset, offset + len(line)
      if len(set(_NAME.findall(line))) < 4:
        continue
      if any(a < offset and lo < b for a, b in covered.get(path, ())):   # overlaps a checked list
        continue
      if any(path == p and marker in line for p, marker in SUBSETS):
        continue
      unknown.append(f"{path}:{n}: {line.strip()[:100]}")
  assert not unknown, ("lists of algorithms this test does not check (derive them from the "
                       "registry, or add them to LISTS / SUBSETS):\n" + "\n".join(unknown))


def test_the_lists_reader_sees_a_stale_list():
  stale = 'algorithm="auto"|"xla"|"ring"|"hierarchical"|"one_shot"|"two_shot" (or a'
  assert FAMILIES - _names(stale, FAMILIES) == {"butterfly"}


def _bench(name):
  sys.path.insert(0, str(ROOT / "bench"))
  try:
    return __import__(name)
  finally:
    sys.path.remove(str(ROOT / "bench"))


def test_bench_candidates_are_the_registrys():
  collectives, allreduce, eager = _bench("collectives"), _bench("allreduce"), _bench("eager")
  for family in FAMILIES:
    assert family in collectives.CANDIDATES and family in allreduce.CANDIDATES, family
    assert f"reproducible_{family}" in collectives.CANDIDATES
    assert f"exact_{family}" in collectives.CANDIDATES
  # eager's mesh has one axis: every family but the one that needs two
  assert set(eager.DEFAULT_ALGORITHMS) == FAMILIES - {"hierarchical"}
