import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src.planning import explain as ex
from dtenjax._src.topology.model import Topology


@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return Mesh(np.array(cpu_devices).reshape(2, 4), ("x", "y"))


def test_lists_every_collective_with_groups_bytes_and_prediction(mesh):
  def f(w, x):
    return jnp.sum(jnp.tanh(x @ w))
  g = jax.jit(jax.grad(f), in_shardings=(NamedSharding(mesh, P("x", "y")),
                                         NamedSharding(mesh, P(("x", "y"), None))))
  out = ex.explain(g, jnp.ones((64, 64)), jnp.ones((32, 64)))
  hlo = g.lower(jnp.ones((64, 64)), jnp.ones((32, 64))).compile().as_text()
  n_hlo = sum(hlo.count(f" {k}(") for k in ("all-reduce", "all-gather", "reduce-scatter",
                                              "all-to-all", "collective-permute"))
  assert out.count() == n_hlo > 0
  kinds = {c.kind for c in out.collectives}
  assert kinds <= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute"}
  for c in out.collectives:
    assert c.nbytes > 0 and c.groups and c.predicted_s > 0
    assert all(d in range(8) for g in c.groups for d in g)
  ar = [c for c in out.collectives if c.kind == "all_reduce"]
  assert ar and ar[0].groups == ((0, 4), (1, 5), (2, 6), (3, 7))   # reduction over mesh axis x
  assert out.memory["argument"] > 0 and "temp" in out.memory
  text = out.table()
  assert "all_reduce" in text and "compiled memory" in text


def test_single_device_program_has_no_collectives():
  out = dtenjax.explain(lambda a: a * 2 + 1, jnp.ones(16)) if hasattr(dtenjax, "explain") else \
      ex.explain(lambda a: a * 2 + 1, jnp.ones(16))
  assert out.count() == 0 and "(no collectives)" in out.table()


def test_prediction_uses_the_given_topology(mesh):
  f = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, P(("x", "y"))))
  x = jnp.ones((8, 1024))
  slow = Topology.current().with_links({"shared_memory": dtenjax.LinkSpec(0.001, 1000.0)})
  fast = ex.explain(f, x)
  slow_out = ex.explain(f, x, topology=slow)
  assert slow_out.count() == fast.count() > 0
  assert slow_out.total_predicted_s > 100 * fast.total_predicted_s


def test_parse_iota_replica_groups():
  groups = ex._parse_groups("replica_groups=[4,2]<=[2,4]T(1,0), dims", 8)
  assert groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert ex._parse_groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert ex._parse_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
