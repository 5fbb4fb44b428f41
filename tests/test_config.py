import logging
import os
import subprocess
import sys

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
    assert config.log_fallback("test-key-1", "custom path unavailable")
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


def test_transport_knobs_are_declared():
  for name in ("DTENJAX_LIBCRYPTO", "DTENJAX_HANDSHAKE_TIMEOUT", "DTENJAX_MAX_PENDING_HANDSHAKES",
               "DTENJAX_TRANSPORT_SEGMENT_BYTES"):
    assert name in config.KNOBS, name


def test_nccl_environment_is_pinned_unless_the_user_chose(monkeypatch):
  from dtenjax._src.gpu import environment  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
  monkeypatch.delenv("DTENJAX_PIN_NCCL", raising=False)
  assert environment.pin() and os.environ["NCCL_NVLS_ENABLE"] == "0"
  monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
  assert not environment.pin() and os.environ["NCCL_NVLS_ENABLE"] == "1"   # the user's choice
  monkeypatch.delenv("NCCL_NVLS_ENABLE")
  monkeypatch.setenv("DTENJAX_PIN_NCCL", "0")
  assert not environment.pin() and "NCCL_NVLS_ENABLE" not in os.environ
