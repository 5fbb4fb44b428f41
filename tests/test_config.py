import logging

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
