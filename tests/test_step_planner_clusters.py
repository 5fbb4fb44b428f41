"""The whole-step planner on the reference clusters (8 x H100 hosts over InfiniBand): an 8B and a
70B-shaped decoder are planned fast, the plan beats or matches every recipe that fits by the
planner's own model, the state is sharded, and only data-parallel replicas (HSDP) or pipeline
stages cross the hosts besides FSDP, tensor parallelism staying inside an NVLink island."""

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax
import pytest

import dtenjax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import _step_models as models


def decoder_70b(batch: int, seq: int = 2048):
  """A 70B-shaped decoder (Llama 3 70B's widths: d 8192, 64 heads, 8 kv heads, ffn 28672, 80
  layers, vocabulary 128256), layers stacked for lax.scan under jax.checkpoint, bf16, AdamW;
  abstract arguments."""
  vocab, d, h, kv, ffn, n = 128256, 8192, 64, 8, 28672, 80
  hd = d // h
  s = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  params = {"embed": s((vocab, d), bf), "unembed": s((d, vocab), bf), "norm": s((d,), bf),
            "layers": {"wq": s((n, d, h, hd), bf), "wk": s((n, d, kv, hd), bf),
                       "wv": s((n, d, kv, hd), bf), "wo": s((n, h, hd, d), bf),
                       "w_gate": s((n, d, ffn), bf), "w_up": s((n, d, ffn), bf),
                       "w_down": s((n, ffn, d), bf), "ln1": s((n, d), bf), "ln2": s((n, d), bf)}}

  def norm(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-5)).astype(x.dtype) * w

  def layer(x, p):
    y = norm(x, p["ln1"])
    q = jnp.einsum("bsd,dhk->bshk", y, p["wq"])
    k = jnp.repeat(jnp.einsum("bsd,dhk->bshk", y, p["wk"]), h // kv, axis=2)
    v = jnp.repeat(jnp.einsum("bsd,dhk->bshk", y, p["wv"]), h // kv, axis=2)
    a = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32), -1).astype(bf)
    x = x + jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqs,bshk->bqhk", a, v), p["wo"])
    y = norm(x, p["ln2"])
    g = jax.nn.silu(jnp.einsum("bsd,df->bsf", y, p["w_gate"]))
    return x + jnp.einsum("bsf,fd->bsd", g * jnp.einsum("bsd,df->bsf", y, p["w_up"]),
                          p["w_down"]), None

  def loss(p, tokens):
    x, _ = jax.lax.scan(jax.checkpoint(layer), jnp.take(p["embed"], tokens, axis=0), p["layers"])
    logits = jnp.einsum("bsd,dv->bsv", norm(x, p["norm"]), p["unembed"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  tx = optax.adamw(1e-4)

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, (params, jax.eval_shape(tx.init, params), s((batch, seq), jnp.int32))


# The chosen mesh (its axes of more than one device), the plan's step time and every recipe's, in
# seconds, as `dtenjax.plan` priced these steps at commit d80c5a3, before planning was made
# faster (each distinct collective priced once per plan, island splits and peak FLOP/s once per
# topology, meshes whose lower bound exceeds the best plan found not solved). Copied from that
# commit's output, not derived: the claim they pin is "no plan and no price changed". The FSDP,
# FSDP x TP and pipeline recipes' times moved once since, deliberately: on these GPU fixtures the
# embedding table sharded over fsdp is priced as plan.jit and XLA:GPU run it, gathered, no longer
# as a masked lookup whose rows are all-reduced (pricing._vocab_axes; the bytes are checked
# against XLA:GPU's in tests/test_step_planner_gpu_memory.py); those are the planner's output
# after that change. The chosen plans' times and the TP and FSDP x TP recipes' moved again, as
# deliberately: a checkpointed layer's row-parallel output is all-reduced again where the
# backward recomputes it, as XLA:GPU compiles llama-1b's (tensor._row_reductions; the bytes are
# checked in tests/test_step_planner_gpu_memory.py). Every chosen mesh is still d80c5a3's.
PINNED = {
    ("8b", "h100_64"): ({"fsdp": 32, "tensor": 2}, 0.21357297410620543, {
        "DP": 0.23860676811561848, "FSDP": 0.30827093221256296, "FSDP x TP": 0.5267063611136867,
        "TP": 0.5384869081856868, "pipeline": 0.24576891352434138}),
    ("70b", "h100_64"): ({"data": 4, "fsdp": 8, "tensor": 2}, 2.118790830863672, {
        "DP": 2.111068186620937, "FSDP": 2.63292616706277, "FSDP x TP": 3.9670852102684626,
        "TP": 4.032371863196462, "pipeline": 2.1266525595144508}),
    ("8b", "h100_256"): ({"fsdp": 128, "tensor": 2}, 0.22117224808458041, {
        "DP": 0.24627913803186846, "FSDP": 0.35236549307043785, "FSDP x TP": 0.5565096798617323,
        "TP": 0.5384869081856868, "pipeline": 0.2525515290793414}),
    ("70b", "h100_256"): ({"data": 16, "fsdp": 8, "tensor": 2}, 2.1855056853289216, {
        "DP": 2.177356286457187, "FSDP": 2.810270888136645, "FSDP x TP": 3.960090211740463,
        "TP": 4.032371863196462, "pipeline": 2.190915638813451}),
    ("8b", "h100_1024"): ({"fsdp": 512, "tensor": 2}, 0.22426694170091893, {
        "DP": 0.24873723051093094, "FSDP": 0.48947913328490666, "FSDP x TP": 0.6949840919417322,
        "TP": 0.5384869081856868, "pipeline": 0.2552174411033414}),
    ("70b", "h100_1024"): ({"data": 64, "fsdp": 8, "tensor": 2}, 2.204206052400589, {
        "DP": 2.1944683114162493, "FSDP": 3.162137068405115, "FSDP x TP": 3.9583414621084616,
        "TP": 4.032371863196462, "pipeline": 2.207511721161451}),
}


@pytest.mark.parametrize("fixture", ["h100_64", "h100_256", "h100_1024"])
def test_8b_and_70b_on_a_cluster(fixture):
  topo = dtenjax.Topology.fixture(fixture)
  n = topo.num_devices
  for name, (step, args) in (
      ("8b", models.llama_step("8b", batch=n, seq=2048, remat=True, dtype=jnp.bfloat16)),
      ("70b", decoder_70b(batch=n))):
    t0 = time.process_time()
    plan = dtenjax.plan(step, *args, topology=topo)
    cpu = time.process_time() - t0
    assert cpu < 2.0, (name, fixture, cpu)
    mesh, total, recipes = PINNED[(name, fixture)]
    assert {a: k for a, k in zip(plan.axis_names, plan.mesh_shape) if k > 1} == mesh
    assert plan.cost.total_s == pytest.approx(total, rel=1e-12, abs=0)
    assert {r.name: r.cost.total_s for r in plan.recipes if r.cost is not None} == pytest.approx(
        recipes, rel=1e-12, abs=0)
    fitting = [r for r in plan.recipes if r.cost is not None and r.cost.fits]
    assert plan.cost.fits
    for r in fitting:
      assert plan.cost.total_s <= r.cost.total_s * (1 + 1e-9), (name, r.name, plan.table())
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    spans = {a.name: a.span for a in plan.axes}
    # the state sharded (FSDP), with replicas (HSDP) or pipeline stages across hosts where the
    # model says they pay, and tensor parallelism inside an NVLink island
    assert sizes["fsdp"] > 1, plan.table()
    for axis, span in (("tensor", "inside an NVLink island"), ("data", "across hosts"),
                       ("stage", "across hosts")):
      assert sizes.get(axis, 1) == 1 or spans[axis] == span, plan.table()
    fsdp = next(r for r in plan.recipes if r.name == "FSDP")
    assert plan.cost.total_s < fsdp.cost.total_s, plan.table()
