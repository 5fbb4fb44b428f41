"""docs/planner.md quotes `bench/planner.py --explain` between two marker lines; this fails when
the quote and the command's output drift apart (rewrite with `bench/planner.py --update-docs`)."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import planner  # noqa: E402


@pytest.fixture(autouse=True)
def _table_costs(monkeypatch):
  monkeypatch.delenv("DTENJAX_COST_PARAMS", raising=False)   # the docs show the default costs


def test_docs_quote_the_explain_output_exactly():
  quote = planner.docs_quote(planner.DOCS.read_text(encoding="utf-8"))
  assert quote == planner.explain_fixtures(), (
      "docs/planner.md is stale: run .venv/bin/python bench/planner.py --update-docs")


def test_explain_prints_plain_text_and_markdown_on_request(capsys):
  assert planner.main(["--explain"]) == 0
  plain = capsys.readouterr().out
  assert "```" not in plain and "###" not in plain
  assert "dgx_a100_8, mesh {'x': 2, 'y': 4}\n" in plain and "\n*2d " in plain
  assert planner.main(["--explain", "--markdown"]) == 0
  assert capsys.readouterr().out == planner.explain_fixtures() + "\n"


def test_the_prose_matches_the_quoted_choices():
  """The paragraph above the quote says 2D on the 8 x A100 node and row-wise on 4 x 8 A100."""
  sections = {part.split(",")[0].strip(): part for part in
              planner.explain_fixtures().split("### ")[1:]}
  assert "\n*2d " in sections["dgx_a100_8"]
  assert "\n*row " in sections["roce_a100_4x8"]
  text = planner.DOCS.read_text(encoding="utf-8")
  assert "on one 8 x A100 NVLink node the weight goes 2D" in text
  assert "on 4 x 8 A100 over RoCE v2 it goes 1D row-wise" in text


def test_update_docs_rewrites_only_the_quote(tmp_path):
  stale = tmp_path / "planner.md"
  original = planner.DOCS.read_text(encoding="utf-8")
  stale.write_text(original.replace("*row       P('gpu', None)", "*2d        P('gpu', None)"),
                   encoding="utf-8")
  assert planner.update_docs(stale) is True
  assert stale.read_text(encoding="utf-8") == original
  assert planner.update_docs(stale) is False
  (tmp_path / "bare.md").write_text("# no markers\n")
  with pytest.raises(SystemExit, match="lacks the marker lines"):
    planner.update_docs(tmp_path / "bare.md")
