"""Six model families and the layouts a user writes for them by hand, without dtenjax.

The families (each a training step with AdamW, ``step(params, opt_state, batch) -> (params,
opt_state, loss)``, its abstract arguments, and its weights' tensor-parallel dimensions):

* ``llama_scan``  -- a Llama-shaped decoder, layers stacked and run by ``lax.scan``;
* ``llama_loop``  -- the same decoder with a Python loop over per-layer weights;
* ``encdec``      -- an encoder-decoder transformer (cross-attention over the encoder's output);
* ``convnet``     -- a small residual convnet with batch norm (running statistics are state);
* ``moe``         -- a transformer whose MLP is a mixture of experts (top-1 routing with a
                     capacity, GShard-style dispatch and combine);
* ``shared``      -- ALBERT-style: one layer's weights applied at every depth.

Every model reads its weights through ``use(path, w)``: the identity for the plain step, and for
the hand-written FSDP recipes a ``with_sharding_constraint`` to the layout the product needs, as
MaxText's and FSDP2's users write it (inside the scan, one layer at a time).

The recipes (:func:`recipe`), plain ``jax.jit`` with ``NamedSharding``s:

* ``DP``        -- parameters replicated, batch split over all devices;
* ``FSDP``      -- parameters, gradients and optimizer state sharded over all devices on their
                   largest dividing dimension (never a stacked layer dimension), gathered where
                   used; batch split over all devices;
* ``FSDP x TP`` -- Megatron tensor parallelism over ``tensor`` (column kernels shard their
                   output dimension, row kernels their input) times FSDP over ``fsdp``;
* ``HSDP``      -- FSDP inside a host (or island) of ``island`` devices, replicas across them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

RECIPES = ("DP", "FSDP", "FSDP x TP", "HSDP")


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  make: Callable[..., tuple[Callable, tuple]]   # make(use) -> (step, args)
  tp: dict[str, int]          # weight path -> its tensor-parallel dimension (Megatron)
  stacked: tuple[str, ...]    # path prefixes of weights stacked for lax.scan (dim 0 = layer)
  real_batch: Callable[[Any], Any]   # abstract batch -> a concrete batch


def _identity(path, w):
  del path
  return w


def _adamw(loss, params, batch, extra_state=None):
  tx = optax.adamw(1e-3)

  def step(params, opt_state, batch):
    if extra_state is None:
      value, grads = jax.value_and_grad(loss)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value
    (value, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return new_params | {"stats": new_stats}, opt_state, value
  return step, (params, jax.eval_shape(tx.init, params), batch)


def _tokens(shape):
  return lambda b: jax.random.randint(jax.random.key(1), b.shape, 0, shape)


def _rms(x, w):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-5)).astype(x.dtype) * w


def _attention(use, pre, y, kv_in, p, heads, causal):
  hd = p["wq"].shape[-1]
  q = jnp.einsum("bsd,dhk->bshk", y, use(pre + "wq", p["wq"]))
  k = jnp.einsum("bsd,dhk->bshk", kv_in, use(pre + "wk", p["wk"]))
  v = jnp.einsum("bsd,dhk->bshk", kv_in, use(pre + "wv", p["wv"]))
  scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) / math.sqrt(hd)
  if causal:
    mask = jnp.tril(jnp.ones((y.shape[1], kv_in.shape[1]), bool))
    scores = jnp.where(mask, scores, -1e9)
  probs = jax.nn.softmax(scores, axis=-1).astype(y.dtype)
  attn = jnp.einsum("bhqs,bshk->bqhk", probs, v)
  del heads
  return jnp.einsum("bqhk,hkd->bqd", attn, use(pre + "wo", p["wo"]))


def _mlp(use, pre, y, p):
  g = jnp.einsum("bsd,df->bsf", y, use(pre + "w_gate", p["w_gate"]))
  u = jnp.einsum("bsd,df->bsf", y, use(pre + "w_up", p["w_up"]))
  return jnp.einsum("bsf,fd->bsd", jax.nn.silu(g) * u, use(pre + "w_down", p["w_down"]))


def _layer_shapes(d, h, ffn, lead=()):
  s = lambda *shape: jax.ShapeDtypeStruct(lead + shape, jnp.float32)
  hd = d // h
  return {"attn_norm": s(d), "mlp_norm": s(d), "wq": s(d, h, hd), "wk": s(d, h, hd),
          "wv": s(d, h, hd), "wo": s(h, hd, d), "w_gate": s(d, ffn), "w_up": s(d, ffn),
          "w_down": s(ffn, d)}


_TP = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "w_gate": 1, "w_up": 1, "w_down": 0}


def _xent(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()


# --- decoder-only, scanned and looped ------------------------------------------------------------

def llama(*, scan: bool, vocab=2048, d=256, heads=8, ffn=1024, layers=4, batch=16, seq=128):
  def make(use=_identity):
    s = jax.ShapeDtypeStruct
    if scan:
      blocks = {"layers": _layer_shapes(d, heads, ffn, (layers,))}
    else:
      blocks = {f"l{i}": _layer_shapes(d, heads, ffn) for i in range(layers)}
    params = {"embed": s((vocab, d), jnp.float32), **blocks,
              "final_norm": s((d,), jnp.float32), "unembed": s((d, vocab), jnp.float32)}

    def block(x, p, pre):
      x = x + _attention(use, pre, _rms(x, p["attn_norm"]), _rms(x, p["attn_norm"]), p, heads,
                         True)
      return x + _mlp(use, pre, _rms(x, p["mlp_norm"]), p)

    def loss(p, tokens):
      x = jnp.take(use("embed", p["embed"]), tokens, axis=0)
      if scan:
        x, _ = jax.lax.scan(lambda x, lp: (block(x, lp, "layers/"), None), x, p["layers"])
      else:
        for i in range(layers):
          x = block(x, p[f"l{i}"], f"l{i}/")
      logits = jnp.einsum("bsd,dv->bsv", _rms(x, p["final_norm"]), use("unembed", p["unembed"]))
      return _xent(logits, tokens)
    return _adamw(loss, params, jax.ShapeDtypeStruct((batch, seq), jnp.int32))

  prefixes = ["layers/"] if scan else [f"l{i}/" for i in range(layers)]
  tp = {pre + k: v + (1 if scan else 0) for pre in prefixes for k, v in _TP.items()}
  tp["unembed"] = 1
  return Family("llama_scan" if scan else "llama_loop", make, tp,
                ("layers/",) if scan else (), _tokens(vocab))


# --- encoder-decoder -----------------------------------------------------------------------------

def encdec(*, vocab=2048, d=256, heads=8, ffn=1024, layers=2, batch=16, seq=64):
  def make(use=_identity):
    s = jax.ShapeDtypeStruct
    enc = {f"e{i}": _layer_shapes(d, heads, ffn) for i in range(layers)}
    dec = {}
    for i in range(layers):
      blk = _layer_shapes(d, heads, ffn)
      blk["cross"] = {k: v for k, v in _layer_shapes(d, heads, ffn).items()
                      if k in ("wq", "wk", "wv", "wo", "attn_norm")}
      dec[f"d{i}"] = blk
    params = {"embed": s((vocab, d), jnp.float32), **enc, **dec,
              "unembed": s((d, vocab), jnp.float32)}

    def loss(p, batch):
      src, tgt = batch[:, 0], batch[:, 1]
      emb = use("embed", p["embed"])
      h = jnp.take(emb, src, axis=0)
      for i in range(layers):
        q, pre = p[f"e{i}"], f"e{i}/"
        y = _rms(h, q["attn_norm"])
        h = h + _attention(use, pre, y, y, q, heads, False)
        h = h + _mlp(use, pre, _rms(h, q["mlp_norm"]), q)
      x = jnp.take(emb, tgt, axis=0)
      for i in range(layers):
        q, pre = p[f"d{i}"], f"d{i}/"
        y = _rms(x, q["attn_norm"])
        x = x + _attention(use, pre, y, y, q, heads, True)
        x = x + _attention(use, pre + "cross/", _rms(x, q["cross"]["attn_norm"]), h, q["cross"],
                           heads, False)
        x = x + _mlp(use, pre, _rms(x, q["mlp_norm"]), q)
      logits = jnp.einsum("bsd,dv->bsv", x, use("unembed", p["unembed"]))
      return _xent(logits, tgt)
    return _adamw(loss, params, jax.ShapeDtypeStruct((batch, 2, seq), jnp.int32))

  tp = {"unembed": 1}
  for i in range(layers):
    for pre in (f"e{i}/", f"d{i}/", f"d{i}/cross/"):
      tp.update({pre + k: v for k, v in _TP.items()
                 if not (pre.endswith("cross/") and k.startswith("w_"))})
  return Family("encdec", make, tp, (), _tokens(vocab))


# --- convnet with batch norm ---------------------------------------------------------------------

def convnet(*, channels=(32, 64, 128), blocks=2, batch=32, image=32, classes=10):
  def make(use=_identity):
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    params, stats = {"stem": s(3, 3, 3, channels[0])}, {}
    cin = channels[0]
    for i, c in enumerate(channels):
      for j in range(blocks):
        name = f"c{i}_{j}"
        params[name] = s(3, 3, cin, c)
        params[name + "_bn"] = {"scale": s(c), "bias": s(c)}
        stats[name] = {"mean": s(c), "var": s(c)}
        cin = c
    params["head"] = s(cin, classes)
    params = params | {"stats": stats}

    def conv(x, w, stride=1):
      return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                          dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def loss(p, batch):
      x, labels = batch["image"], batch["label"]
      x = jax.nn.relu(conv(x, use("stem", p["stem"])))
      new_stats = {}
      cin = channels[0]
      for i, c in enumerate(channels):
        for j in range(blocks):
          name = f"c{i}_{j}"
          y = conv(x, use(name, p[name]), 2 if (j == 0 and i > 0) else 1)
          mean, var = jnp.mean(y, (0, 1, 2)), jnp.var(y, (0, 1, 2))
          old = p["stats"][name]
          new_stats[name] = {"mean": 0.9 * old["mean"] + 0.1 * jax.lax.stop_gradient(mean),
                             "var": 0.9 * old["var"] + 0.1 * jax.lax.stop_gradient(var)}
          y = (y - mean) * jax.lax.rsqrt(var + 1e-5)
          y = y * p[name + "_bn"]["scale"] + p[name + "_bn"]["bias"]
          x = jax.nn.relu(y + x) if (cin == c) else jax.nn.relu(y)
          cin = c
      logits = jnp.mean(x, (1, 2)) @ use("head", p["head"])
      value = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return value, new_stats

    batch_ = {"image": s(batch, image, image, 3),
              "label": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    return _adamw(loss, params, batch_, extra_state=True)

  def real(b):
    return {"image": jax.random.normal(jax.random.key(1), b["image"].shape),
            "label": jax.random.randint(jax.random.key(2), b["label"].shape, 0, classes)}
  tp = {f"c{i}_{j}": 3 for i in range(len(channels)) for j in range(blocks)}
  return Family("convnet", make, tp, (), real)


# --- mixture of experts --------------------------------------------------------------------------

def moe(*, vocab=2048, d=256, heads=8, ffn=512, experts=8, layers=2, batch=16, seq=64,
        capacity_factor=2.0):
  def make(use=_identity):
    s = jax.ShapeDtypeStruct
    blocks = {}
    for i in range(layers):
      blk = {k: v for k, v in _layer_shapes(d, heads, ffn).items() if not k.startswith("w_")}
      blk.update(router=s((d, experts), jnp.float32), e_in=s((experts, d, ffn), jnp.float32),
                 e_out=s((experts, ffn, d), jnp.float32))
      blocks[f"l{i}"] = blk
    params = {"embed": s((vocab, d), jnp.float32), **blocks,
              "unembed": s((d, vocab), jnp.float32)}
    cap = int(capacity_factor * seq / experts)

    def experts_mlp(y, q, pre):
      gates = jax.nn.softmax(jnp.einsum("bsd,de->bse", y, use(pre + "router", q["router"])), -1)
      choice = jnp.argmax(gates, -1)
      onehot = jax.nn.one_hot(choice, experts, dtype=y.dtype)              # b s e
      pos = jnp.cumsum(onehot, axis=1) * onehot - 1.0                      # slot per expert
      keep = (pos < cap) & (pos >= 0)
      dispatch = jax.nn.one_hot(jnp.where(keep, pos, -1).astype(jnp.int32), cap,
                                dtype=y.dtype)                             # b s e c
      combine = dispatch * jnp.sum(gates * onehot, -1)[..., None, None]
      # "dispatch"/"combine": where expert parallelism by hand routes the tokens (expert_recipe)
      xin = use(pre + "dispatch", jnp.einsum("bsec,bsd->ebcd", dispatch, y))
      hid = jax.nn.gelu(jnp.einsum("ebcd,edf->ebcf", xin, use(pre + "e_in", q["e_in"])))
      out = use(pre + "combine", jnp.einsum("ebcf,efd->ebcd", hid, use(pre + "e_out", q["e_out"])))
      return jnp.einsum("bsec,ebcd->bsd", combine, out)

    def loss(p, tokens):
      x = jnp.take(use("embed", p["embed"]), tokens, axis=0)
      for i in range(layers):
        q, pre = p[f"l{i}"], f"l{i}/"
        y = _rms(x, q["attn_norm"])
        x = x + _attention(use, pre, y, y, q, heads, True)
        x = x + experts_mlp(_rms(x, q["mlp_norm"]), q, pre)
      logits = jnp.einsum("bsd,dv->bsv", x, use("unembed", p["unembed"]))
      return _xent(logits, tokens)
    return _adamw(loss, params, jax.ShapeDtypeStruct((batch, seq), jnp.int32))

  tp = {"unembed": 1}
  for i in range(layers):
    tp.update({f"l{i}/{k}": v for k, v in _TP.items() if not k.startswith("w_")})
    tp.update({f"l{i}/e_in": 2, f"l{i}/e_out": 1})
  return Family("moe", make, tp, (), _tokens(vocab))


# --- weights shared across layers ---------------------------------------------------------------

def shared(*, vocab=2048, d=256, heads=8, ffn=1024, depth=6, batch=16, seq=128):
  def make(use=_identity):
    s = jax.ShapeDtypeStruct
    params = {"embed": s((vocab, d), jnp.float32), "block": _layer_shapes(d, heads, ffn),
              "unembed": s((d, vocab), jnp.float32)}

    def loss(p, tokens):
      x = jnp.take(use("embed", p["embed"]), tokens, axis=0)
      q = p["block"]
      for _ in range(depth):
        y = _rms(x, q["attn_norm"])
        x = x + _attention(use, "block/", y, y, q, heads, True)
        x = x + _mlp(use, "block/", _rms(x, q["mlp_norm"]), q)
      logits = jnp.einsum("bsd,dv->bsv", x, use("unembed", p["unembed"]))
      return _xent(logits, tokens)
    return _adamw(loss, params, jax.ShapeDtypeStruct((batch, seq), jnp.int32))

  tp = {"block/" + k: v for k, v in _TP.items()} | {"unembed": 1}
  return Family("shared", make, tp, (), _tokens(vocab))


FAMILIES: dict[str, Callable[..., Family]] = {
    "llama_scan": lambda **kw: llama(scan=True, **kw),
    "llama_loop": lambda **kw: llama(scan=False, **kw),
    "encdec": encdec, "convnet": convnet, "moe": moe, "shared": shared,
}


# --- the recipes a user writes -------------------------------------------------------------------

def _path(kp) -> str:
  parts = []
  for k in kp:
    key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
    parts.append(str(key))
  return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str
  mesh: Mesh
  param_specs: Any       # a PartitionSpec per parameter leaf
  compute: dict[str, Any]  # weight path -> the layout its product needs (FSDP gathers); a list
                           # of layouts is applied in turn (expert parallelism's routed tokens)
  batch_axes: tuple[str, ...]

  def use(self, path, w):
    spec = self.compute.get(path)
    if spec is None:
      return w
    for s in spec if isinstance(spec, list) else [spec]:
      w = jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, P(*tuple(s)[-w.ndim:])))
    return w


def _fsdp_dim(shape, skip: set[int], n: int) -> int | None:
  best = None
  for i, s in enumerate(shape):
    if i not in skip and s % n == 0 and s >= n and (best is None or s > shape[best]):
      best = i
  return best


def recipe(family: Family, name: str, devices=None, island: int = 4) -> Recipe | None:
  """The layout ``name`` (one of :data:`RECIPES`) for ``family``, as a user writes it by hand;
  None where it does not apply (no tensor-parallel weight divides ``tensor``)."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  n = devices.size
  if name == "DP":
    mesh, fsdp_axes, tp_axis = Mesh(devices.reshape(n), ("data",)), (), None
  elif name == "FSDP":
    mesh, fsdp_axes, tp_axis = Mesh(devices.reshape(n), ("fsdp",)), ("fsdp",), None
  elif name == "FSDP x TP":
    mesh, fsdp_axes, tp_axis = Mesh(devices.reshape(n // 2, 2), ("fsdp", "tensor")), ("fsdp",), \
        "tensor"
  elif name == "HSDP":
    if n <= island:
      return None
    mesh = Mesh(devices.reshape(n // island, island), ("data", "fsdp"))
    fsdp_axes, tp_axis = ("fsdp",), None
  else:
    raise ValueError(f"recipe {name!r}: one of {RECIPES}")
  _, args = family.make()
  nf = math.prod(mesh.shape[a] for a in fsdp_axes) if fsdp_axes else 1
  compute: dict[str, P] = {}
  any_tp = False

  def spec_of(kp, leaf):
    nonlocal any_tp
    path = _path(kp)
    entries: list = [None] * leaf.ndim
    skip = {0} if any(path.startswith(s) for s in family.stacked) else set()
    if tp_axis is not None and path in family.tp and leaf.shape[family.tp[path]] % 2 == 0:
      entries[family.tp[path]] = tp_axis
      skip.add(family.tp[path])
      any_tp = True
    gathered = list(entries)
    if fsdp_axes and leaf.ndim >= 2:
      d = _fsdp_dim(leaf.shape, skip, nf)
      if d is not None:
        entries[d] = fsdp_axes[0] if len(fsdp_axes) == 1 else fsdp_axes
        compute[path] = P(*gathered)
    return P(*entries)

  param_specs = jax.tree_util.tree_map_with_path(spec_of, args[0])
  if tp_axis is not None and not any_tp:
    return None
  batch_axes = tuple(a for a in mesh.axis_names if a != "tensor")
  return Recipe(name, mesh, param_specs, compute, batch_axes)


def expert_recipe(family: Family, devices=None) -> Recipe | None:
  """Expert parallelism as GShard and MaxText users write it, for the ``moe`` family (None for
  the others): every expert weight sharded over ``expert`` on its expert dimension, the rest
  replicated, the batch split over ``expert``; the dispatched tokens constrained first as the
  batch holds them, then onto their experts' devices (one all-to-all), and the experts' output
  the other way back."""
  if family.name != "moe":
    return None
  devices = np.asarray(jax.devices() if devices is None else devices)
  mesh = Mesh(devices.reshape(devices.size), ("expert",))
  _, args = family.make()
  u = P.UNCONSTRAINED
  there, home = P("expert", u, u, u), P(None, u, u, u)
  compute: dict[str, Any] = {}
  for key in args[0]:
    if key.startswith("l"):
      compute[f"{key}/dispatch"] = [home, there]
      compute[f"{key}/combine"] = [there, home]
  param_specs = jax.tree_util.tree_map_with_path(
      lambda kp, leaf: P("expert") if _path(kp).split("/")[-1] in ("e_in", "e_out") else P(),
      args[0])
  return Recipe("EP", mesh, param_specs, compute, ("expert",))


def _like_params(opt_state, params, param_specs):
  """Optimizer-state specs: a moment laid out as the parameter whose path ends its own path."""
  by_path = {}
  for (kp, _), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                           jax.tree.leaves(param_specs, is_leaf=lambda s: isinstance(s, P))):
    by_path[_path(kp)] = spec

  def one(kp, leaf):
    path = _path(kp)
    for p_path, spec in by_path.items():
      # whole path components: "mu/unembed" is unembed's moment, not embed's
      if (path == p_path or path.endswith("/" + p_path)) and len(tuple(spec)) <= leaf.ndim:
        return spec
    return P()
  return jax.tree_util.tree_map_with_path(one, opt_state)


def recipe_jit(family: Family, r: Recipe, donate: bool = False):
  """``(jitted step, shardings of (params, opt, batch))``: the user's step under ``r``."""
  step, args = family.make(r.use)
  params, opt, batch = args
  pspecs = r.param_specs
  ospecs = _like_params(opt, params, pspecs)
  bax = r.batch_axes[0] if len(r.batch_axes) == 1 else r.batch_axes
  bspecs = jax.tree.map(lambda b: P(bax), batch)
  named = lambda t: jax.tree.map(lambda s: NamedSharding(r.mesh, s), t,
                                 is_leaf=lambda s: isinstance(s, P))
  ins = (named(pspecs), named(ospecs), named(bspecs))
  outs = (ins[0], ins[1], NamedSharding(r.mesh, P()))
  fn = jax.jit(step, in_shardings=ins, out_shardings=outs,
               donate_argnums=(0, 1) if donate else ())
  return fn, ins


def real_args(family: Family, seed: int = 0):
  """Concrete arguments: small random parameters, the optimizer's state, a batch."""
  step, (params, _, batch) = family.make()
  del step
  leaves, tree = jax.tree.flatten(params)

  sizes = [math.prod(leaf.shape) for leaf in leaves]

  @jax.jit
  def init(key):   # one program and one draw (a draw per leaf compiled a generator per leaf)
    flat = 0.02 * jax.random.normal(key, (sum(sizes),), jnp.float32)
    ends = list(itertools.accumulate(sizes))
    p = jax.tree.unflatten(tree, [flat[e - n:e].reshape(leaf.shape).astype(leaf.dtype)
                                  for leaf, n, e in zip(leaves, sizes, ends)])
    return p, optax.adamw(1e-3).init(p)

  params, opt = init(jax.random.key(seed))
  return params, opt, family.real_batch(batch)
