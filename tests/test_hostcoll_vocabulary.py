"""net/hostcoll.py keeps no hand list: its ops are the transport's (the extension's frame.h
vocabulary) that have a local XLA reduction for stage 1 of "hierarchical", its algorithms the
keys of its table of implementations, which the registry's host records must match."""

import jax.numpy as jnp
import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.net import hostcoll
import transport_ref


def test_ops_are_the_transports_with_a_local_reduction():
  # lax has psum_scatter, pmax and pmin, no product reduction: the wire's "prod" is not offered.
  assert set(ffi.vocabulary("transport.op")) == set(transport_ref.OPS)
  assert set(hostcoll.OPS) == set(transport_ref.OPS) & {"sum", "max", "min"}
  assert set(hostcoll.ALL_OPS) == set(hostcoll.OPS) | {"mean"}


def test_an_op_the_wire_has_but_this_module_does_not_is_refused_by_name():
  with pytest.raises(errors.CollectiveError) as e:
    hostcoll._check(jnp.ones((4,), jnp.float32), ("x",), "ring", "prod")
  assert "op='prod' is not one of ['max', 'mean', 'min', 'sum']" in str(e.value)
  with pytest.raises(errors.CollectiveError) as e:
    hostcoll._check(jnp.ones((4,), jnp.float32), ("x",), "tree", "sum")
  assert "algorithm='tree' is not one of ('ring', 'hierarchical')" in str(e.value)
  assert "op=" not in str(e.value)


def test_algorithms_are_the_registrys_host_families():
  host = {a.family for a in registry.REGISTRY if a.name.startswith("host_")}
  assert set(hostcoll.ALGORITHMS) == host == {"ring", "hierarchical"}
