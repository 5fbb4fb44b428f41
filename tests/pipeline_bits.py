"""One training step of the small Llama (``dtenjax.testing.pipeline_model``) pipelined over a
``stage`` mesh axis and unpipelined, with the gradients averaged over ``data`` by dtenjax's
reproducible sum; prints one JSON line per configuration with the digests of both steps' loss
and updated parameters (layers back in layer order).

``python tests/pipeline_bits.py [--layers N] STAGES[xDATA]:SCHEDULE[:remat] ...`` (SCHEDULE gpipe,
1f1b or interleaved; ``remat`` wraps the layer in ``jax.checkpoint``; ``N`` layers, default the
model's 16) on the process's devices (8, or 16 for 8 stages x 2 data shards): each configuration
uses the first ``stages x data`` devices
(``data`` defaults to all devices / ``stages``), ``MICRO``
micro-batches of ``ROWS`` sequences per data shard; configurations with the same ``data`` share
one unpipelined run. Used by ``tests/test_pipeline.py`` (with ``--xla_cpu_max_isa=AVX``, so the bits do not
depend on how XLA fuses the two programs) and by the multi-process worker
(``tests/mp_workers/pipeline_worker.py``), which runs the pipelined step across processes.
"""

from __future__ import annotations

import hashlib
import json
import sys

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax.testing import pipeline_model as pm
from tests.mp_workers import common

MICRO, ROWS = 8, 2
SCHEDULES = {"gpipe": dtenjax.GPipe(), "1f1b": dtenjax.OneFOneB(),
             "interleaved": dtenjax.Interleaved(virtual=2)}


def _mesh(shape, names, devices):
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names)


def _place(tree, mesh, specs):
  def one(x, spec):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])
  return jax.tree.map(one, tree, specs)


def _digest(loss, params) -> str:
  h = hashlib.sha256()
  for leaf in [loss] + jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return h.hexdigest()[:16]


def options(argv: list[str]) -> tuple[int, list[str]]:
  """``[--layers N] SPEC ...`` -> (the model's layer count, the specs)."""
  if argv[:1] == ["--layers"]:
    return int(argv[1]), argv[2:]
  return pm.CONFIG["layers"], argv


def pipelined(stages: int, schedule: str, devices, *, remat: bool = False,
              layers: int = pm.CONFIG["layers"]) -> str:
  data = len(devices) // stages
  mesh = _mesh((stages, data), ("stage", "data"), devices)
  body = jax.checkpoint(pm.body) if remat else pm.body
  pipe = dtenjax.pipeline(body, pm.loss_fn, stages=stages, microbatches=MICRO,
                          schedule=SCHEDULES[schedule])
  tx = optax.adamw(1e-2)
  params = pm.init(layers=layers)
  staged = {**params, "layers": jax.tree.map(np.asarray, pipe.to_stages(params["layers"]))}
  specs = pm.param_specs(params, "stage")
  opt = common.zero_state(tx.init, staged)
  ospecs = pm.opt_specs(opt, params, specs)
  toks = pm.tokens(data * MICRO * ROWS)
  step = jax.jit(jax.shard_map(pm.pipelined_step(pipe, tx, data_size=data), mesh=mesh,
                               in_specs=(specs, ospecs, P("data")), out_specs=(specs, ospecs, P())))
  with jax.set_mesh(mesh):
    new, _, loss = step(_place(staged, mesh, specs), _place(opt, mesh, ospecs),
                        _place(toks, mesh, P("data")))
  new, loss = common.gathered((new, loss))
  new = {**new, "layers": jax.tree.map(np.asarray, pipe.from_stages(new["layers"]))}
  return _digest(loss, new)


def reference(data: int, devices, *, remat: bool = False,
              layers: int = pm.CONFIG["layers"]) -> str:
  mesh = _mesh((data,), ("data",), devices[:data])
  tx = optax.adamw(1e-2)
  params = pm.init(layers=layers)
  specs = pm.param_specs(params, None)
  opt = common.zero_state(tx.init, params)
  ospecs = pm.opt_specs(opt, params, specs)
  toks = pm.tokens(data * MICRO * ROWS)
  layer = jax.checkpoint(pm.body) if remat else pm.body
  step = jax.jit(jax.shard_map(pm.reference_step(MICRO, tx, data_size=data, layer=layer), mesh=mesh,
                               in_specs=(specs, ospecs, P("data")), out_specs=(specs, ospecs, P())))
  with jax.set_mesh(mesh):
    new, _, loss = step(params, opt, toks)
  return _digest(np.asarray(loss), jax.tree.map(np.asarray, new))


def main(argv):
  devices = jax.devices()
  layers, specs = options(argv)
  refs = {}
  for spec in specs:
    shape, schedule, *rest = spec.split(":")
    stages, _, data = shape.partition("x")
    stages = int(stages)
    data, remat = int(data) if data else len(devices) // stages, "remat" in rest
    if (data, remat) not in refs:
      refs[data, remat] = reference(data, devices, remat=remat, layers=layers)
    got = pipelined(stages, schedule, devices[:stages * data], remat=remat, layers=layers)
    print(json.dumps({"config": spec, "pipelined": got, "reference": refs[data, remat]}),
          flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
