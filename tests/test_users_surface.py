"""The public surface outside the planner, called the way a user of JAX writes it: ``jax.jit``
with NamedShardings, ``jax.set_mesh``, plain ``jax.shard_map`` with its default
``check_vma=True``, flax/optax state, odd sizes (zero-size, scalars) and bad input. Each test
here stands for a program a user wrote from the docs that failed; the expected values come from
plain JAX, numpy or orbax, and bad input must raise a ``DtenjaxError`` that names the value and
the fix, never a raw JAX traceback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dtenjax
import dtenjax.checkpoint as ckpt


def _bits(x):
  a = np.ascontiguousarray(np.asarray(x))
  return a.dtype, a.shape, a.reshape(-1).view(np.uint8).tobytes()


# --- checkpoints ------------------------------------------------------------------------------

def test_a_zero_size_leaf_round_trips_and_orbax_reads_it(tmp_path):
  """A state with an empty array (a zero-width layer, an empty buffer) saved without complaint
  used to be unrestorable: the zarr metadata said chunks [0, 4], which dtenjax's own restore
  refused as a damaged checkpoint and tensorstore (orbax) could not open."""
  mesh = jax.make_mesh((8,), ("x",))
  tree = {"empty": jax.device_put(jnp.zeros((0, 4)), NamedSharding(mesh, P())),
          "empty_cols": jax.device_put(jnp.zeros((8, 0), jnp.bfloat16), NamedSharding(mesh, P("x"))),
          "np_empty": np.zeros((3, 0), np.int32),
          "w": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))}
  ckpt.save(tmp_path / "c", tree)
  out = ckpt.restore(tmp_path / "c")
  for k, v in tree.items():
    assert _bits(out[k]) == _bits(v), k
  assert out["empty_cols"].sharding == tree["empty_cols"].sharding
  ocp = pytest.importorskip("orbax.checkpoint")
  theirs = ocp.PyTreeCheckpointer().restore(str(tmp_path / "c"))
  for k, v in tree.items():
    assert _bits(theirs[k]) == _bits(v), k


def test_saving_inside_jit_names_the_leaf_and_the_fix(tmp_path):
  """``ckpt.save`` called inside a jitted (or differentiated) step used to fail with JAX's
  "The 'sharding' attribute is not available on traced array" AttributeError."""
  with pytest.raises(dtenjax.ConfigurationError, match=r"leaf 'params\.w' is a traced value.*"
                     r"outside"):
    jax.jit(lambda w: ckpt.save(tmp_path / "c", {"params": {"w": w}, "step": 1}))(jnp.ones(3))
  assert not (tmp_path / "c").exists()
