import ast
import logging
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import dtenjax
from dtenjax._src import config


def test_knobs_are_prefixed_and_documented():
  for name, knob in config.KNOBS.items():
    assert name.startswith("DTENJAX_") and knob.help


def test_typed_getters_name_the_bad_value(monkeypatch):
  monkeypatch.setenv("DTENJAX_COLLECTIVE_TIMEOUT", "soon")
  with pytest.raises(dtenjax.ConfigurationError, match=r"DTENJAX_COLLECTIVE_TIMEOUT='soon'"):
    config.get_float("DTENJAX_COLLECTIVE_TIMEOUT")
  monkeypatch.setenv("DTENJAX_COLLECTIVE_TIMEOUT", "2.5")
  assert config.get_float("DTENJAX_COLLECTIVE_TIMEOUT") == 2.5
  monkeypatch.setenv("DTENJAX_SILENCE_FALLBACK", "maybe")
  with pytest.raises(dtenjax.ConfigurationError, match="boolean"):
    config.get_bool("DTENJAX_SILENCE_FALLBACK")


def test_log_fallback_logs_once_and_can_be_silenced(monkeypatch, caplog):
  monkeypatch.delenv("DTENJAX_SILENCE_FALLBACK", raising=False)
  with caplog.at_level(logging.WARNING, logger="dtenjax"):
    with pytest.warns(dtenjax.DtenjaxWarning, match="custom path unavailable"):
      assert config.log_fallback("test-key-1", "custom path unavailable")
    with warnings.catch_warnings():
      warnings.simplefilter("error")        # the second time: neither a record nor a warning
      assert not config.log_fallback("test-key-1", "custom path unavailable")
  assert sum("custom path unavailable" in r.message for r in caplog.records) == 1
  assert "DTENJAX_SILENCE_FALLBACK=1" in caplog.records[0].message
  monkeypatch.setenv("DTENJAX_SILENCE_FALLBACK", "1")
  assert not config.log_fallback("test-key-2", "quiet")


def _run(code: str, **env) -> subprocess.CompletedProcess:
  e = dict(os.environ)
  e.pop("DTENJAX_LOG_LEVEL", None)
  e.update(env)
  return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                        timeout=120)


def test_dtenjax_never_configures_the_root_logger():
  """A fresh process: logging through dtenjax leaves the root logger and the application's
  logging configuration alone; dtenjax's logger carries only a NullHandler."""
  out = _run(
      "import logging\n"
      "from dtenjax._src import config\n"
      "config.log_once('k', 'hello from dtenjax')\n"
      "root = logging.getLogger()\n"
      "lg = logging.getLogger('dtenjax')\n"
      "print('ROOT', root.handlers, root.level)\n"
      "print('DTENJAX', [type(h).__name__ for h in lg.handlers], lg.level)\n")
  assert out.returncode == 0, out.stderr
  assert "ROOT [] 30" in out.stdout                      # untouched: no handlers, WARNING
  assert "DTENJAX ['NullHandler'] 0" in out.stdout       # level left to the application
  assert "hello from dtenjax" not in out.stderr          # nothing printed behind the app's back


def test_records_reach_the_applications_handlers_once():
  out = _run(
      "import logging\n"
      "logging.basicConfig(format='APP %(name)s %(levelname)s %(message)s')\n"
      "from dtenjax._src import config\n"
      "config.log_once('k', 'visible notice')\n"
      "config.log_once('k', 'visible notice')\n")
  assert out.returncode == 0, out.stderr
  assert out.stderr.count("APP dtenjax WARNING visible notice") == 1, out.stderr


def test_log_level_knob_applies_only_when_set_and_is_validated():
  out = _run("import logging\nfrom dtenjax._src import config\nconfig.log_once('k', 'x')\n"
             "print(logging.getLogger('dtenjax').level)\n", DTENJAX_LOG_LEVEL="info")
  assert out.stdout.strip() == "20", out.stderr
  out = _run("from dtenjax._src import config\nconfig.log_once('k', 'x')\n",
             DTENJAX_LOG_LEVEL="chatty")
  assert out.returncode != 0 and "DTENJAX_LOG_LEVEL='CHATTY' is not a logging level" in out.stderr


_ROOT = pathlib.Path(dtenjax.__file__).resolve().parent
_ENV_READ = re.compile(r'getenv\(\s*"(DTENJAX_[A-Z0-9_]+)"')


def _knob_reads(path: pathlib.Path) -> set[str]:
  """DTENJAX_* names the Python module at ``path`` reads: ``config.get_*("X")``,
  ``os.environ.get("X")`` / ``os.getenv("X")`` / ``os.environ["X"]``."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    arg = None
    if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
      f = node.func
      if (f.attr.startswith("get") and isinstance(f.value, (ast.Name, ast.Attribute))
          and getattr(f.value, "id", getattr(f.value, "attr", "")) in ("config", "environ", "os")):
        arg = node.args[0]
    elif isinstance(node, ast.Subscript) and getattr(node.value, "attr", "") == "environ":
      arg = node.slice
    if isinstance(arg, ast.Constant) and str(arg.value).startswith("DTENJAX_"):
      found.add(arg.value)
  return found


def _all_knob_reads() -> dict[str, str]:
  reads = {}
  for path in _ROOT.rglob("*.py"):
    for name in _knob_reads(path):
      reads.setdefault(name, str(path.relative_to(_ROOT.parent)))
  for d in ("csrc", "custom_calls"):
    for path in (_ROOT.parent / d).rglob("*"):
      if path.suffix in (".cc", ".h", ".cu", ".cuh"):
        for name in _ENV_READ.findall(path.read_text(errors="replace")):
          reads.setdefault(name, str(path.relative_to(_ROOT.parent)))
  return reads


def test_every_knob_the_code_reads_is_declared():
  """Every DTENJAX_* variable read anywhere in the package (Python through config or os.environ,
  native code through getenv) is a declared knob, so config's table is the whole list."""
  reads = _all_knob_reads()
  # The scan sees the transport's settings (read in net/native.py and net/transport.py) and the
  # collectives'.
  assert {"DTENJAX_LIBCRYPTO", "DTENJAX_HANDSHAKE_TIMEOUT", "DTENJAX_MAX_PENDING_HANDSHAKES",
          "DTENJAX_TRANSPORT_SEGMENT_BYTES", "DTENJAX_BUCKET_BYTES"} <= set(reads), sorted(reads)
  undeclared = {n: where for n, where in reads.items() if n not in config.KNOBS}
  assert not undeclared, f"read but not declared in config.KNOBS: {undeclared}"


def test_the_knob_scan_sees_every_form_of_read(tmp_path):
  mod = tmp_path / "m.py"
  mod.write_text("import os\nfrom dtenjax._src import config\n"
                 "a = config.get_int('DTENJAX_A')\nb = os.environ.get('DTENJAX_B')\n"
                 "c = os.getenv('DTENJAX_C')\nd = os.environ['DTENJAX_D']\n"
                 "e = config.get_str('OTHER')\n")
  assert _knob_reads(mod) == {"DTENJAX_A", "DTENJAX_B", "DTENJAX_C", "DTENJAX_D"}
  assert _ENV_READ.findall('const char* v = std::getenv("DTENJAX_E");') == ["DTENJAX_E"]


def test_nccl_environment_is_pinned_when_asked_unless_the_user_chose(monkeypatch):
  import dtenjax
  from dtenjax._src.gpu import environment
  monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
  monkeypatch.delenv("DTENJAX_PIN_NCCL", raising=False)
  assert not environment.pin_if_asked() and "NCCL_NVLS_ENABLE" not in os.environ   # default
  assert dtenjax.pin_nccl() and os.environ["NCCL_NVLS_ENABLE"] == "0"             # explicit
  monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
  assert not dtenjax.pin_nccl() and os.environ["NCCL_NVLS_ENABLE"] == "1"   # the user's choice
  monkeypatch.delenv("NCCL_NVLS_ENABLE")
  monkeypatch.setenv("DTENJAX_PIN_NCCL", "1")
  assert environment.pin_if_asked() and os.environ["NCCL_NVLS_ENABLE"] == "0"   # the knob


def test_importing_dtenjax_changes_no_environment_variable():
  import subprocess
  import sys
  code = ("import os, json; before = dict(os.environ); import dtenjax; "
          "[getattr(dtenjax, n) for n in dtenjax.__all__]; after = dict(os.environ); "   # loaded
          "print(json.dumps(sorted(k for k in set(before) | set(after) "
          "if before.get(k) != after.get(k))))")
  env = {k: v for k, v in os.environ.items() if k not in ("NCCL_NVLS_ENABLE", "DTENJAX_PIN_NCCL")}
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                     timeout=120, check=True)
  assert r.stdout.strip() == "[]", r.stdout
