"""Worker: the public dtenjax.all_reduce across processes (one device per process, or two with
DTENJAX_TEST_LOCAL=2), under plain jax.shard_map, dtenjax.mesh_map and jax.set_mesh.

For each case it records the result's bits, whether the compiled program calls the host transport,
and the reference the test compares with (computed here from the full global input)."""

from __future__ import annotations

import traceback

from tests.mp_workers import common


def main():
  rank, nprocs = common.init()
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import dtenjax

  local = jax.local_device_count()
  res: dict = {"rank": rank, "nprocs": nprocs, "local": local, "cases": {}}
  devs = np.array(jax.devices()).reshape(nprocs, local)
  if local == 1:
    mesh, axes = Mesh(devs.reshape(-1), ("p",)), ("p",)
  else:
    mesh, axes = Mesh(devs, ("p", "l")), ("p", "l")
  spec = P(axes)
  n = nprocs * local
  rng = np.random.RandomState(7)
  full = (rng.randn(n, 33) * np.exp(rng.uniform(-8, 8, (n, 33)))).astype(np.float32)
  full[1 % n, 3] = np.nan
  arr = jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec), lambda i: full[i])
  res["input"] = full.view(np.uint32).tolist()

  def run(name, wrap, **kw):
    def body(v):
      return dtenjax.all_reduce(v, axes if len(axes) > 1 else axes[0], **kw)
    f = jax.jit(wrap(body))
    try:
      hlo = f.lower(arr).compile().as_text()
      out = [np.asarray(s.data) for s in f(arr).addressable_shards]
      again = [np.asarray(s.data) for s in f(arr).addressable_shards]
      res["cases"][name] = {
          "bits": [o.view(np.uint32).tolist() for o in out],
          "repeat_equal": all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                              for a, b in zip(out, again)),
          "host_transport": "dtenjax_host_all_reduce" in hlo}
    except Exception as e:
      res["cases"][name] = {"exception": f"{type(e).__name__}: {e}",
                            "trace": traceback.format_exc()[-3000:]}

  smap = lambda body: jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                    check_vma=False)
  mmap = lambda body: dtenjax.mesh_map(body, mesh, in_specs=spec, out_specs=spec)
  family = "ring" if local == 1 else "hierarchical"
  for wrap_name, wrap in (("shard_map", smap), ("mesh_map", mmap)):
    run(f"{wrap_name}/{family}", wrap, algorithm=family)
    run(f"{wrap_name}/auto", wrap)
    run(f"{wrap_name}/auto_max", wrap, op="max")
    run(f"{wrap_name}/reproducible", wrap, reproducible=True)
    run(f"{wrap_name}/{family}_reproducible", wrap, algorithm=family, reproducible=True)
  with jax.set_mesh(mesh):
    run(f"set_mesh/{family}", smap, algorithm=family)
  common.finish(res)


if __name__ == "__main__":
  main()
