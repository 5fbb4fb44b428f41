"""Tests of dtenjax._src.topology.report (``python -m dtenjax topo``)."""

import pytest

from dtenjax._src.cli.main import main as cli
from dtenjax._src.topology import report
from dtenjax._src.topology.model import LinkSpec, Topology


def _matrix_rows(text, n):
  """The n matrix rows: the lines after the header line of device labels."""
  lines = text.splitlines()
  header = next(i for i, ln in enumerate(lines) if ln.split()[:1] in (["GPU0"], ["CPU0"]))
  return [ln.split() for ln in lines[header + 1:header + 1 + n]]


def _legend(text, code):
  """Tokens of the legend line of ``code``: code, class, GB/s, 'GB/s', us, 'us', meaning..."""
  legend = text.split("Legend")[1].split("Summary:")[0]
  return next(ln.split() for ln in legend.splitlines() if ln.split()[:1] == [code])


def test_dgx_matrix_and_legend():
  t = Topology.fixture("dgx_a100_8")
  text = report.link_matrix_table(t)
  header = next(ln for ln in text.splitlines() if ln.strip().startswith("GPU0"))
  assert header.split()[:8] == [f"GPU{i}" for i in range(8)]
  rows = _matrix_rows(text, 8)
  for i, row in enumerate(rows):
    assert row[0] == f"GPU{i}"
    assert row[1:9] == ["X" if j == i else "NV" for j in range(8)]
  assert _legend(text, "NV")[:6] == ["NV", "nvlink", "300.00", "GB/s", "2.50", "us"]
  assert _legend(text, "X")[1] == "local"
  assert "RoCE" not in text and "PIX" not in text   # only classes present are in the legend
  assert "fast islands: 1 -> 0-7" in text
  assert "NUMA node 1 on 'node0'" in text
  assert "seed reference" in text


def test_roce_matrix_hosts_and_nics():
  t = Topology.fixture("roce_a100_4x8")
  text = report.link_matrix_table(t)
  rows = _matrix_rows(text, 32)
  assert rows[0][1:3] == ["X", "NV"] and rows[0][9] == "RoCE"
  assert rows[9][-1] == "node1"            # host column appears with several hosts
  assert "fast islands: 4 -> 0-7; 8-15; 16-23; 24-31" in text
  assert "NIC mlx5_3 on 'node3' port 1: Ethernet, ACTIVE, 100 Gb/s" in text
  assert _legend(text, "RoCE")[:6] == ["RoCE", "roce", "12.50", "GB/s", "5.00", "us"]


def test_pcie_codes_and_measured_values_shown():
  t = Topology.fixture("pcie_8").with_links({"pcie": LinkSpec(21.5, 3.25)}, notes=["probed"])
  text = report.link_matrix_table(t)
  rows = _matrix_rows(text, 8)
  assert rows[0][1:9] == ["X", "PIX", "PIX", "PIX", "SYS", "SYS", "SYS", "SYS"]
  assert _legend(text, "PIX")[:6] == ["PIX", "pcie", "21.50", "GB/s", "3.25", "us"]
  assert _legend(text, "SYS")[2] == "16.00"
  assert "source: probed" in text and "  - probed" in text


def test_every_class_has_a_code():
  assert report.CODES["nvswitch"] == "NVS" and report.CODES["tcp"] == "TCP"
  assert "NVS" in report.link_matrix_table(Topology.fixture("h200_8"))


def test_topo_fixture_json_and_save(tmp_path, capsys):
  out = tmp_path / "t.json"
  assert cli(["topo", "--fixture", "h200_8", "--save", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "Topology 'h200_8'" in printed and "saved to" in printed
  assert Topology.from_json(out) == Topology.fixture("h200_8")
  assert cli(["topo", "--load", str(out)]) == 0
  assert "NVS" in capsys.readouterr().out
  assert cli(["topo", "--load", str(out), "--json"]) == 0          # bare --json: to stdout
  assert Topology.from_json(capsys.readouterr().out) == Topology.fixture("h200_8")


def test_topo_errors_are_one_line_exit_2_for_usage_and_1_for_files(tmp_path, capsys):
  assert cli(["topo", "--fixture", "nope"], prog="dtenjax") == 2     # one grammar for every
  err = capsys.readouterr().err                                      # command (test_cli_grammar)
  assert err.startswith("dtenjax topo: error: --fixture 'nope': ") and err.count("\n") == 1
  assert "dgx_a100_8" in err and "Traceback" not in err
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  assert cli(["topo", "--load", str(bad)], prog="dtenjax") == 1
  err = capsys.readouterr().err
  assert err.startswith("dtenjax topo: error: ") and "is not valid JSON" in err
  assert err.count("\n") == 1
  assert cli(["topo", "--load", str(tmp_path / "missing.json")], prog="dtenjax") == 1
  err = capsys.readouterr().err
  assert "cannot read topology file" in err and err.count("\n") == 1
  unwritable = tmp_path / "no-such-dir" / "t.json"
  for flag in ("--json", "--save"):
    assert cli(["topo", "--fixture", "h200_8", flag, str(unwritable)], prog="dtenjax") == 1
    err = capsys.readouterr().err
    assert err.startswith("dtenjax topo: error: --json ") and "cannot write it" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
  with pytest.raises(SystemExit) as e:
    cli(["topo", "--fixture", "dgx_a100_8", "--load", str(bad)])
  assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
  assert cli(["topo", "--fixture", "dgx_a100_8", "--probe"], prog="dtenjax") == 2
  assert "none of topology 'dgx_a100_8'" in capsys.readouterr().err


def test_topo_detect_and_probe(cpu_devices, capsys):
  del cpu_devices
  assert cli(["topo", "--probe"]) == 0
  text = capsys.readouterr().out
  assert "CPU0" in text and "SHM" in text and "source: probed" in text
  assert "probed shared_memory" in text


def test_transport_notes_say_why_once_and_without_native_source_paths():
  reason = ("pyverbs is not installed; libibverbs.so.1 lists no RDMA device "
            "(ibv_get_device_list: Function not implemented)")
  notes = report._transport_notes([
      f"no RDMA NIC: {reason} (/src/dtenjax/csrc/transport/verbs.cc:338)",
      f"host transport: tcp (verbs is not usable: {reason} (/src/dtenjax/csrc/transport/verbs.cc:338))"])
  assert notes == [f"no RDMA NIC: {reason}",
                   "host transport: tcp (verbs is not usable: no RDMA NIC (above))"]
