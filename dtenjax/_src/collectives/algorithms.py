"""XLA-native collective algorithms with a fixed reduction order.

Each function here runs inside a named-axis context (``jax.shard_map``, ``mesh_map``, or
``jax.vmap(..., axis_name=...)``) and is written only with XLA's own data-movement collectives
(``ppermute``, ``all_gather``, ``all_to_all``) plus local arithmetic whose order we choose. No
custom call rendezvouses across devices, so they are safe on XLA's CPU runtime (see DESIGN.md:
in-process blocking custom-call collectives deadlock it) and run on every backend.

Reduction order, per element (what ``deterministic=True`` guarantees; ``+`` is ``op``):

- ``one_shot``: all_gather, then ``((x_0 + x_1) + x_2) + ... + x_{n-1}`` over ranks 0..n-1.
- ``two_shot``: all_to_all, the same rank order 0..n-1 on the owned chunk, then all_gather.
  Same bits as ``one_shot`` for every element and every buffer layout.
- ``ring``: reduce-scatter phase over ``ppermute`` (n-1 steps), then all-gather phase (n-1 steps).
  Chunk ``c`` of the padded flat buffer is summed in rank order ``c+1, c+2, ..., c`` (mod n),
  so bits depend on the element's chunk, i.e. on the buffer length and n, never on timing.
- ``hierarchical`` over axes ``(outer..., inner)``: inner reduce-scatter (rank order 0..m-1 of the
  inner axis), one-shot across the outer axes in their order, inner all-gather; element value
  ``sum_o (sum_i x_{o,i})``.

Sums of bfloat16/float16 accumulate in float32 and round once at the end (the bit contract the
GPU one-shot kernel in ``p2p.py`` shares). Integer sums, max and min are exact in any order.
All algorithms give identical bits on every rank because the final phase copies one reduced value
to everyone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

AxisName = str | tuple[str, ...]

ALGORITHMS = ("xla", "ring", "hierarchical", "one_shot", "two_shot")
OPS = ("sum", "mean", "max", "min")


def axis_tuple(axis_name: AxisName) -> tuple[str, ...]:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_size(axis_name: AxisName) -> int:
  """Static size of the (possibly combined) named axis."""
  return int(lax.axis_size(axis_tuple(axis_name)))


def acc_dtype(dtype, op: str):
  """Accumulation dtype: float32 for sums of 16-bit floats, the input dtype otherwise."""
  dtype = jnp.dtype(dtype)
  if op in ("sum", "mean") and dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return jnp.dtype(jnp.float32)
  return dtype


def combiner(op: str) -> Callable:
  return {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum}[op]


def ordered_reduce(stack, op: str, dtype=None):
  """Reduces ``stack`` over axis 0 left to right: ``((s[0] + s[1]) + s[2]) + ...``.

  An explicit chain of binary ops (XLA does not reassociate floating-point adds), unlike
  ``jnp.sum`` whose order is up to the backend's reduction emitter.
  """
  dtype = dtype or acc_dtype(stack.dtype, op)
  comb = combiner(op)
  acc = stack[0].astype(dtype)
  for i in range(1, stack.shape[0]):
    acc = comb(acc, stack[i].astype(dtype))
  return acc


def _chunked(x, n: int):
  """Flat ``x`` padded with zeros to ``n`` equal chunks: ``[n, c]`` and the true size."""
  flat = x.reshape(-1)
  size = flat.shape[0]
  c = -(-size // n) if size else 1
  flat = jnp.pad(flat, (0, n * c - size))
  return flat.reshape(n, c), size


def _take(chunks, i):
  return lax.dynamic_index_in_dim(chunks, i, axis=0, keepdims=False)


# --- reduce-scatter building blocks: [n, c] chunks in, owned chunk (rank r gets chunk r) out ----

def ring_reduce_scatter_chunks(chunks, axis_name: AxisName, op: str):
  """Ring reduce-scatter over ``ppermute``: rank r ends with chunk r reduced (acc dtype).

  Step s (0..n-2): rank r sends its partial of chunk (r-1-s) mod n to rank r+1, which adds its
  own value of that chunk (received partial first, own value second).
  """
  n = chunks.shape[0]
  chunks = chunks.astype(acc_dtype(chunks.dtype, op))
  if n == 1:
    return chunks[0]
  comb = combiner(op)
  r = lax.axis_index(axis_tuple(axis_name))
  perm = [(i, (i + 1) % n) for i in range(n)]
  send = _take(chunks, (r - 1) % n)
  for s in range(n - 1):
    recv = lax.ppermute(send, axis_tuple(axis_name), perm)
    send = comb(recv, _take(chunks, (r - 2 - s) % n))
  return send


def ring_all_gather_chunks(chunk, axis_name: AxisName, n: int):
  """Ring all-gather over ``ppermute``: rank r contributes ``chunk`` as block r of ``[n, c]``."""
  if n == 1:
    return chunk[None]
  r = lax.axis_index(axis_tuple(axis_name))
  perm = [(i, (i + 1) % n) for i in range(n)]
  out = jnp.zeros((n,) + chunk.shape, chunk.dtype)
  out = lax.dynamic_update_index_in_dim(out, chunk, r, axis=0)
  cur = chunk
  for s in range(n - 1):
    cur = lax.ppermute(cur, axis_tuple(axis_name), perm)
    out = lax.dynamic_update_index_in_dim(out, cur, (r - 1 - s) % n, axis=0)
  return out


def a2a_reduce_scatter_chunks(chunks, axis_name: AxisName, op: str):
  """all_to_all, then rank order 0..n-1 on the owned chunk (acc dtype)."""
  n = chunks.shape[0]
  if n == 1:
    return chunks[0].astype(acc_dtype(chunks.dtype, op))
  recv = lax.all_to_all(chunks, axis_tuple(axis_name), 0, 0)
  return ordered_reduce(recv, op)


def gather_reduce_scatter_chunks(chunks, axis_name: AxisName, op: str):
  """all_gather of everything, then rank order 0..n-1 on the owned chunk (acc dtype)."""
  n = chunks.shape[0]
  if n == 1:
    return chunks[0].astype(acc_dtype(chunks.dtype, op))
  g = lax.all_gather(chunks, axis_tuple(axis_name))          # [n_ranks, n_chunks, c]
  r = lax.axis_index(axis_tuple(axis_name))
  mine = lax.dynamic_index_in_dim(g, r, axis=1, keepdims=False)   # [n_ranks, c]
  return ordered_reduce(mine, op)


# --- all-reduce: x in, reduced x out; ``finish`` maps the acc-dtype result to the output ---------

def one_shot(x, axis_name: AxisName, op: str, finish: Callable):
  n = axis_size(axis_name)
  if n == 1:
    return finish(x.astype(acc_dtype(x.dtype, op)))
  return finish(ordered_reduce(lax.all_gather(x, axis_tuple(axis_name)), op))


def two_shot(x, axis_name: AxisName, op: str, finish: Callable):
  n = axis_size(axis_name)
  chunks, size = _chunked(x, n)
  mine = finish(a2a_reduce_scatter_chunks(chunks, axis_name, op))
  full = lax.all_gather(mine, axis_tuple(axis_name), tiled=True) if n > 1 else mine
  return full[:size].reshape(x.shape)


def ring(x, axis_name: AxisName, op: str, finish: Callable):
  n = axis_size(axis_name)
  chunks, size = _chunked(x, n)
  mine = finish(ring_reduce_scatter_chunks(chunks, axis_name, op))
  full = ring_all_gather_chunks(mine, axis_name, n).reshape(-1)
  return full[:size].reshape(x.shape)


def hierarchical(x, axis_name: AxisName, op: str, finish: Callable):
  """Reduce-scatter inside the last (fast, island) axis, one-shot across the others, gather."""
  axes = axis_tuple(axis_name)
  if len(axes) < 2:
    raise ValueError("hierarchical needs at least two axes")   # checked earlier with a fix
  outer, inner = axes[:-1], axes[-1]
  m = axis_size(inner)
  chunks, size = _chunked(x, m)
  part = a2a_reduce_scatter_chunks(chunks, inner, op)
  if axis_size(outer) > 1:
    part = ordered_reduce(lax.all_gather(part, outer), op, part.dtype)
  mine = finish(part)
  full = lax.all_gather(mine, inner, tiled=True) if m > 1 else mine
  return full[:size].reshape(x.shape)


def xla_psum(x, axis_name: AxisName, op: str, finish: Callable):
  """XLA's own all-reduce (reduction order unspecified for floats)."""
  axes = axis_tuple(axis_name)
  if op in ("sum", "mean"):
    y = lax.psum(x.astype(acc_dtype(x.dtype, op)), axes)
  elif op == "max":
    y = lax.pmax(x, axes)
  else:
    y = lax.pmin(x, axes)
  return finish(y)


ALL_REDUCE = {"one_shot": one_shot, "two_shot": two_shot, "ring": ring,
              "hierarchical": hierarchical, "xla": xla_psum}


# --- reduce-scatter and all-gather on a leading block axis ----------------------------------------

def reduce_scatter_blocks(blocks, axis_name: AxisName, op: str, algorithm: str,
                          deterministic: bool):
  """``blocks``: ``[n, ...]``; rank r gets block r reduced over ranks (acc dtype)."""
  n = blocks.shape[0]
  rest = blocks.shape[1:]
  flat = blocks.reshape(n, -1)
  if algorithm == "ring":
    out = ring_reduce_scatter_chunks(flat, axis_name, op)
  elif algorithm == "one_shot":
    out = gather_reduce_scatter_chunks(flat, axis_name, op)
  elif algorithm == "xla" and not deterministic and op in ("sum", "mean") and n > 1:
    out = lax.psum_scatter(flat.astype(acc_dtype(flat.dtype, op)), axis_tuple(axis_name),
                           scatter_dimension=0, tiled=False)
  else:   # two_shot, and xla in deterministic mode (all_to_all + ordered reduction)
    out = a2a_reduce_scatter_chunks(flat, axis_name, op)
  return out.reshape(rest)


def all_gather_blocks(x, axis_name: AxisName, algorithm: str):
  """``[n, *x.shape]``: block i is rank i's ``x``. Pure data movement: bits never depend on it."""
  n = axis_size(axis_name)
  if algorithm == "ring":
    return ring_all_gather_chunks(x, axis_name, n)
  return lax.all_gather(x, axis_tuple(axis_name)) if n > 1 else x[None]


def candidates(axis_name: AxisName, op: str, dtype, deterministic: bool,
               kind: str = "all_reduce") -> Sequence[str]:
  """Algorithms ``auto`` may pick for this call."""
  out = ["one_shot", "two_shot", "ring"]
  if kind == "all_reduce" and len(axis_tuple(axis_name)) >= 2:
    out.append("hierarchical")
  exact = op in ("max", "min") or not jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  if not deterministic or exact:
    out.append("xla")
  return out
