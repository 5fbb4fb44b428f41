"""scripts/xla_dump_peak.py (gpumem18's reader of XLA's dumps) on a dump XLA:CPU writes here."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

_STEP = """
import json, jax, jax.numpy as jnp
def f(w, x):
  h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
  return jnp.sum(h ** 2)
compiled = jax.jit(jax.grad(f)).lower(jnp.ones((4, 64, 64)), jnp.ones((32, 64))).compile()
print(json.dumps({"temp": compiled.memory_analysis().temp_size_in_bytes}))
"""


def _reader():
  spec = importlib.util.spec_from_file_location("xla_dump_peak", ROOT / "scripts" / "xla_dump_peak.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_dump_reader_finds_xlas_temp_and_a_peak_no_larger(tmp_path):
  """A scanned step's gradient compiled with XLA's dump on: the temp buffer the reader takes
  from the buffer assignment is the one `memory_analysis()` reports (two of XLA's outputs, the
  dump and the compiled object), and the largest sum of values the reader finds live at once is
  within the heap (XLA places every live value in it) and close to it (a live range that is
  wrong by a loop's schedule would miss by a value's size)."""
  dump = tmp_path / "dump"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
  out = subprocess.run([sys.executable, "-c", _STEP], env=env, capture_output=True, text=True,
                       timeout=120, check=True)
  temp = json.loads(out.stdout.strip().splitlines()[-1])["temp"]
  one = tmp_path / "one"
  one.mkdir()
  for f in dump.glob("*jit_f*after_optimizations*.txt"):
    (one / f.name).write_text(f.read_text())
  got = _reader().peak(str(one))
  assert got["temp_mib"] * 2**20 == temp
  assert 0.95 * temp <= got["peak_live_mib"] * 2**20 <= temp
