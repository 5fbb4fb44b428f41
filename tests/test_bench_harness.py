"""bench/_harness.py: sizes, round-robin timing, nccl-tests columns, ratios, the one JSON schema,
tables and refusals. Expected numbers are worked out by hand from nccl-tests' definitions
(algbw = bytes / time; busbw = algbw * 2(n-1)/n for all-reduce, (n-1)/n for all-gather)."""

import argparse
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _harness as h  # noqa: E402


@pytest.mark.parametrize("text,expected", [("8", 8), ("64K", 65536), ("1M", 1 << 20),
                                           ("1.5g", 3 << 29), (" 4kb ", 4096)])
def test_parse_size(text, expected):
  assert h.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "x", "0", "1.5", "-4K"])
def test_parse_size_rejects(text):
  with pytest.raises(ValueError, match="size"):
    h.parse_size(text)


def test_sizes_and_counts_are_argparse_errors():
  assert h.sizes_arg("8,64K,") == [8, 65536]
  with pytest.raises(argparse.ArgumentTypeError, match="'12Q'"):
    h.sizes_arg("8,12Q")
  with pytest.raises(argparse.ArgumentTypeError, match="names no size"):
    h.sizes_arg(",")
  assert h.positive_int("3") == 3
  with pytest.raises(argparse.ArgumentTypeError, match="^0 is less than 1$"):
    h.positive_int("0")
  with pytest.raises(argparse.ArgumentTypeError, match="^'x' is not a whole number$"):
    h.positive_int("x")


def test_nccl_columns_by_hand():
  row = h.nccl_columns(1 << 20, "float32", 100e-6, 8)
  assert row["size"] == 1048576 and row["count"] == 262144 and row["type"] == "float32"
  assert row["time_us"] == pytest.approx(100.0)
  assert row["algbw"] == pytest.approx(10.48576)
  assert row["busbw"] == pytest.approx(10.48576 * 1.75)
  gather = h.nccl_columns(4096, "bfloat16", 1e-6, 4, op="all_gather")
  assert gather["count"] == 2048 and gather["busbw"] == pytest.approx(4.096 * 0.75)
  assert h.bus_factor("all_reduce", 1) == 1.0
  with pytest.raises(ValueError, match="unknown collective"):
    h.bus_factor("allreduce", 2)


def test_ratios_side_by_side_per_group():
  rows = [dict(size=8, algorithm="psum", time_us=10.0), dict(size=8, algorithm="ring", time_us=5.0),
          dict(size=16, algorithm="ring", time_us=4.0)]
  h.add_ratios(rows, "psum")
  assert [r["ratio"] for r in rows] == [1.0, 2.0, None]     # size 16 has no psum row
  assert h.fmt_ratio(2.0) == "2.00x" and h.fmt_ratio(None) == "-"


def test_interleaved_is_round_robin_after_warmup():
  calls = []
  fns = {"a": lambda x: calls.append(("a", x)), "b": lambda x: calls.append(("b", x))}
  samples = h.interleaved(fns, (7,), warmup=2, iters=3)
  assert calls[:4] == [("a", 7), ("a", 7), ("b", 7), ("b", 7)]        # warm-up, per candidate
  assert calls[4:] == [("a", 7), ("b", 7)] * 3                          # timed: one of each per round
  assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3}
  assert all(t >= 0 for v in samples.values() for t in v)


def _doc(**over):
  rows = [dict(h.nccl_columns(8, "float32", 1e-5, 2), algorithm="psum")]
  doc = h.document("allreduce", str(ROOT / "bench" / "allreduce.py"), ["--sizes", "8"],
                   {"sizes": [8]}, rows)
  doc.update(over)
  return doc


def test_document_has_the_schema_fields():
  doc = _doc()
  assert h.validate(doc) == []
  assert doc["schema"] == "dtenjax.bench/1"
  assert doc["command"] == "python bench/allreduce.py --sizes 8"
  assert {"host", "platform", "cpus"} <= set(doc["machine"])
  assert doc["versions"]["python"].count(".") == 2 and "jax" in doc["versions"]
  assert json.loads(json.dumps(doc)) == doc


def test_validate_lists_every_problem():
  bad = _doc(schema="dtenjax.bench/0", date="yesterday", extra=1, rows=[{"size": 8}, 3])
  del bad["machine"]
  problems = h.validate(bad)
  text = "\n".join(problems)
  assert "schema is 'dtenjax.bench/0'" in text
  assert "missing key 'machine'" in text
  assert "date 'yesterday'" in text
  assert "unknown key 'extra'" in text
  assert "rows[0] lacks the nccl-tests columns ['count', 'type', 'time_us', 'algbw', 'busbw']" in text
  assert "rows[1] must be an object" in text
  assert h.validate([]) == ["the document must be a JSON object, got list"]


def test_write_json_says_where_and_refuses_bad_documents(tmp_path, capsys):
  path = tmp_path / "r.json"
  assert h.write_json(str(path), _doc()) == str(path)
  assert f"wrote {path}" in capsys.readouterr().err
  assert h.load(str(path))["bench"] == "allreduce"
  with pytest.raises(ValueError, match="missing key 'rows'"):
    h.write_json(str(tmp_path / "bad.json"), {k: v for k, v in _doc().items() if k != "rows"})
  assert not (tmp_path / "bad.json").exists()
  (tmp_path / "old.json").write_text(json.dumps({"argv": [], "rows": []}))
  with pytest.raises(ValueError, match="is not a dtenjax.bench/1 document"):
    h.load(str(tmp_path / "old.json"))


def test_table_columns_and_formats():
  rows = [dict(size=8, algorithm="psum", time_us=10.0, ratio=1.0),
          dict(size=8, algorithm="one_shot", time_us=4.0, ratio=2.5),
          dict(size=8, algorithm="auto", time_us=None, ratio=None)]
  text = h.table(rows, [("size", "size", "d"), ("algorithm", "algorithm", "s"),
                        ("time(us)", "time_us", ".1f"), ("vs psum", "ratio", "ratio")])
  lines = text.splitlines()
  assert lines[0].split() == ["size", "algorithm", "time(us)", "vs", "psum"]
  assert [ln.split() for ln in lines[1:]] == [["8", "psum", "10.0", "1.00x"],
                                              ["8", "one_shot", "4.0", "2.50x"],
                                              ["8", "auto", "-", "-"]]
  # numbers right-aligned, text left-aligned: the time column ends where its header ends
  end = lines[0].index("time(us)") + len("time(us)")
  assert [ln[end - 4:end] for ln in lines[1:]] == ["10.0", " 4.0", "   -"]
  assert lines[2].index("one_shot") == lines[0].index("algorithm")


def test_refusals_exit_3_with_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    h.require_world("bench/x.py", 1, how="Run it with --procs 2.")
  assert e.value.code == h.EXIT_CANNOT_MEASURE == 3
  err = capsys.readouterr().err.strip()
  assert err == ("bench/x.py: cannot measure here: a collective over 1 rank(s) moves no data; it "
                 "needs at least 2. Run it with --procs 2.")
  h.require_world("bench/x.py", 2)          # enough ranks: returns


def test_require_gpu_refuses_on_cpu(cpu_devices, capsys):
  del cpu_devices
  with pytest.raises(SystemExit) as e:
    h.require_gpu("bench/p2p_allreduce.py", "the p2p kernels")
  assert e.value.code == 3
  err = capsys.readouterr().err
  assert "needs a CUDA GPU (the p2p kernels), and jax's backend is 'cpu'" in err and err.count("\n") == 1


def test_a_chain_no_slower_than_the_empty_one_is_not_reported(capsys):
  """A candidate whose chain took no longer than the empty chain (the timer's noise) gives no
  row: no "0.0 us ... 275579x" printed as if measured."""
  assert h.per_op_seconds(1.5e-3, 1.0e-3, 10) == pytest.approx(5e-5)
  assert h.per_op_seconds(1.0e-3, 1.0e-3, 10, what="psum at 8 B") is None
  assert h.per_op_seconds(0.9e-3, 1.0e-3, 10) is None          # faster than nothing
  assert h.per_op_seconds(1.01e-3, 1.0e-3, 10) is None         # within 2 %
  err = capsys.readouterr().err
  assert "psum at 8 B" in err and "not reported" in err


def test_progress_reports_every_step_on_stderr_in_a_log(capsys):
  seen = list(h.progress([8, 65536, 2**20], "allreduce", h.format_size))
  assert seen == [8, 65536, 2**20]
  out, err = capsys.readouterr()
  assert out == ""                                          # stdout keeps only the tables
  lines = err.splitlines()
  assert [ln.split(" (")[0] for ln in lines] == ["# allreduce: 8 B", "# allreduce: 64 KiB",
                                                 "# allreduce: 1 MiB"]
  assert "(3 of 3," in lines[-1]


def test_progress_on_a_terminal_is_a_bar_on_stderr_that_leaves_stdout_to_the_tables(
    monkeypatch, capsys):
  import io

  class Terminal(io.StringIO):
    def isatty(self):
      return True
  term = Terminal()
  monkeypatch.setattr(sys, "stderr", term)
  with h.steps("checkpoint", 4) as step:
    for size in ("1 GiB", "4 GiB"):
      for candidate in ("dtenjax", "orbax"):
        step(f"{size}, {candidate}")
        print(f"row {size} {candidate}")                  # a bench's output inside the loop
  assert capsys.readouterr().out.splitlines() == [
      "row 1 GiB dtenjax", "row 1 GiB orbax", "row 4 GiB dtenjax", "row 4 GiB orbax"]
  drawn = term.getvalue()
  assert "checkpoint: 4 GiB, orbax" in drawn and "\x1b[" in drawn    # a live bar, redrawn
  assert "# checkpoint" not in drawn                       # not the log's lines


# Benches that finish in a moment need no progress (costmodel_check reads a stored result);
# step_planner's parts report themselves (it is the lead's).
QUICK_OR_OWN = {"costmodel_check", "step_planner"}


def test_every_bench_reports_its_progress():
  """Each bench that runs longer than a few seconds steps a progress report (:func:`steps`,
  :func:`progress`) through its loop, itself or in the helper module it hands the work to
  (tests/test_bench_scripts.py sees the lines of several on a real run)."""
  import ast
  bench = ROOT / "bench"

  def calls(name: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse((bench / f"{name}.py").read_text())):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and getattr(node.func.value, "id", None) == "_harness"):
        found.add(node.func.attr)
      elif isinstance(node, ast.Import):
        found |= {f"import {a.name}" for a in node.names if a.name.startswith("_")}
    return found
  silent = []
  for path in sorted(bench.glob("*.py")):
    if path.stem.startswith("_") or path.stem in QUICK_OR_OWN:
      continue
    seen = calls(path.stem)
    for helper in [s.removeprefix("import ") for s in seen if s.startswith("import _")]:
      if helper != "_harness":
        seen |= calls(helper)
    if not {"steps", "progress"} & seen:
      silent.append(path.name)
  assert not silent, f"benches without a progress report: {silent}"


def test_a_result_with_sizes_gets_a_chart_next_to_its_json(tmp_path, capsys):
  pytest.importorskip("matplotlib", reason="the plot extra (in the test extra)")
  rows = [dict(h.nccl_columns(size, "float32", t, 8), algorithm=a, world=8, backend="cpu")
          for size, t in ((1024, 2e-5), (65536, 8e-5)) for a in ("psum", "ring")]
  doc = h.document("collectives", "bench/collectives.py", ["--sizes", "1K,64K"], {}, rows)
  path = h.write_json(str(tmp_path / "r.json"), doc)
  png = tmp_path / "r.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"              # a PNG beside the JSON
  assert f"wrote {png}" in capsys.readouterr().err
  assert h.load(path)["rows"] == rows
  table_only = dict(doc, rows=[{"model": "mlp", "step_ms": 3.0}])
  assert h.chart(table_only, str(tmp_path / "none.png")) is None     # nothing to draw
  assert not (tmp_path / "none.png").exists()


def test_a_result_of_ratios_per_family_gets_grouped_bars(tmp_path):
  pytest.importorskip("matplotlib", reason="the plot extra (in the test extra)")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [{"part": "wins", "family": f, "layout": lay, "vs_best_recipe": v}
          for f, lay, v in (("encdec", "plan", 0.91), ("encdec", "DP", 0.99),
                            ("moe", "plan", 0.87), ("moe", "DP", 1.33))]
  rows.append({"part": "wins", "family": "moe", "layout": "TP", "vs_best_recipe": None})  # not run
  fig, ax = plt.subplots()
  h._draw_ratios(ax, h._ratio_rows(rows))
  heights = {(round(p.get_x() + p.get_width() / 2), round(p.get_height(), 2)) for p in ax.patches}
  assert heights == {(0, 0.91), (0, 0.99), (1, 0.87), (1, 1.33)}       # 2 families x 2 layouts
  assert [line.get_ydata()[0] for line in ax.lines] == [1.05]           # the bar to stay under
  plt.close(fig)
  doc = h.document("step_planner", "bench/step_planner.py", ["--parts", "wins"], {}, rows)
  png = tmp_path / "wins.png"
  assert h.chart(doc, str(png)) == str(png)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
