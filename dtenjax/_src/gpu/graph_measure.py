"""``cuda_graphs="measure"``: compile the candidate policies, time a few steps, keep the fastest.

Where ``auto``'s static rule cannot show a win (short runs between convolutions, a loop whose run
would drag other runs into graphs), only timing can tell. :func:`measure`:

1. fingerprints XLA's default executable (sha256 of its optimised HLO, the device kind and the
   jax version) and returns a cached decision for it when there is one (in this process, and in
   ``cache_path``, a JSON file, when given);
2. takes as candidates the policies whose PREDICTED launches differ from XLA's defaults
   (:func:`candidates`: auto's rule, +WHILE, min_graph_size 2, both; at most three survive,
   policies that predict the same launches as the defaults or as each other are dropped);
3. compiles each (donation removed: the same arguments are reused) and times ``steps`` runs of
   every candidate and of XLA's defaults, interleaved (the order rotates every repeat),
   ``repeats`` times;
4. keeps a candidate only if its median beats the defaults' by ``margin`` and it is faster in
   at least 80 % of the repeats (:func:`choose`); otherwise XLA's defaults, nothing passed.

Cost (``MeasuredChoice.cost_s`` says it for the step at hand): one XLA compile per candidate
(XLA's defaults are compiled again without donation) plus ``(warmup + repeats * steps)`` runs of
each of the ``k + 1`` executables; with the defaults (steps=10, repeats=5, warmup=2) that is
52 (k + 1) steps. A cache hit costs one hash of the HLO text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from dtenjax._src import errors
from dtenjax._src import hlo
from dtenjax._src.gpu import graph_policy as gp
from dtenjax._src.gpu import graph_prediction as pred

BASELINE = "xla"
_CACHE: dict[str, MeasuredChoice] = {}


@dataclasses.dataclass(frozen=True)
class MeasuredChoice:
  """The measured decision for one executable.

  Attributes:
    policy: the chosen policy (XLA's defaults, not explicit, unless a candidate won).
    fingerprint: the executable fingerprint the decision is cached under.
    seconds: {candidate: median seconds per step}; "xla" is XLA's defaults.
    per_repeat: {candidate: seconds per step in each repeat}.
    candidates: {candidate: the policy, described}.
    reason: why this one.
    cost_s: wall seconds the measurement took (compiles and runs); 0 for a cache hit.
    cached: whether the decision came from the cache.
  """
  policy: gp.CudaGraphPolicy
  fingerprint: str
  seconds: dict[str, float]
  per_repeat: dict[str, list[float]]
  candidates: dict[str, str]
  reason: str
  cost_s: float
  cached: bool = False

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["policy"] = dataclasses.asdict(self.policy)
    return d


def fingerprint(compiled: Any) -> str:
  """sha256 of XLA's default executable's optimised HLO, the device kind and the jax version."""
  kind = jax.devices()[0].device_kind
  text = compiled.as_text()
  return hashlib.sha256(f"{jax.__version__}\n{kind}\n{text}".encode()).hexdigest()


def _signature(p) -> tuple:
  return tuple((s.computation, s.ops, s.captured) for s in p.segments)


def candidates(module: hlo.Module, trips: Mapping[str, int] | None = None
               ) -> dict[str, gp.CudaGraphPolicy]:
  """{name: policy} of the policies predicted to launch differently from XLA's defaults."""
  default = gp.CudaGraphPolicy.from_mode("xla")
  seen = {_signature(pred.plan(module, default, trips))}
  out = {}
  auto, _ = pred.decide_auto(module, trips)
  options = [("auto", auto),
             ("while", gp.CudaGraphPolicy.xla_default_plus("measure", ("WHILE",))),
             ("min2", gp.CudaGraphPolicy.xla_default_plus("measure", (), 2)),
             ("while+min2", gp.CudaGraphPolicy.xla_default_plus("measure", ("WHILE",), 2))]
  for name, policy in options:
    if policy.is_xla_default:
      continue
    sig = _signature(pred.plan(module, policy, trips))
    if sig in seen:
      continue
    seen.add(sig)
    out[name] = dataclasses.replace(policy, mode="measure")
  return out


def choose(per_repeat: Mapping[str, Sequence[float]], margin: float = 0.05,
           baseline: str = BASELINE) -> tuple[str, str]:
  """(the winner, why) from seconds per step per repeat (pure).

  The fastest median wins only if it beats ``baseline``'s median by ``margin`` (a fraction) and
  is faster than the baseline in at least 80 % of the repeats (paired by repeat); otherwise the
  baseline.
  """
  if baseline not in per_repeat:
    raise errors.ConfigurationError(f"choose: no {baseline!r} timings among {sorted(per_repeat)}")
  med = {k: statistics.median(v) for k, v in per_repeat.items()}
  best = min(med, key=med.get)
  base = med[baseline]
  if best == baseline:
    return baseline, f"XLA's defaults were fastest ({base * 1e6:.1f} us/step)"
  wins = sum(b < a for a, b in zip(per_repeat[baseline], per_repeat[best]))
  gain = base / med[best]
  if med[best] > base * (1.0 - margin) or wins < 0.8 * len(per_repeat[best]):
    return baseline, (f"{best} was {gain:.3f}x XLA's defaults ({wins} of "
                      f"{len(per_repeat[best])} repeats faster), inside the {margin:.0%} margin: "
                      "XLA's defaults")
  return best, (f"{best} measured {gain:.3f}x XLA's defaults ({med[best] * 1e6:.1f} vs "
                f"{base * 1e6:.1f} us/step, faster in {wins} of {len(per_repeat[best])} repeats)")


def _load(cache_path: str | None) -> dict[str, Any]:
  if not cache_path or not os.path.exists(cache_path):
    return {}
  try:
    with open(cache_path) as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.ConfigurationError(
        f"cuda_graphs='measure': cannot read its cache {cache_path!r} ({e}); delete the file or "
        "pass another cache_path.") from None
  return data if isinstance(data, dict) else {}


def _from_json(fp: str, d: Mapping[str, Any]) -> MeasuredChoice:
  p = d["policy"]
  policy = gp.CudaGraphPolicy(p["mode"], tuple(p["commands"]), int(p["min_graph_size"]),
                              bool(p["explicit"]))
  return MeasuredChoice(policy, fp, dict(d["seconds"]), {k: list(v) for k, v in
                                                         d["per_repeat"].items()},
                        dict(d["candidates"]), d["reason"], 0.0, cached=True)


def measure(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *,
            jit_kwargs: Mapping[str, Any], user_options: Mapping[str, Any],
            default_compiled: Any, steps: int = 10, repeats: int = 5, warmup: int = 2,
            margin: float = 0.05, cache_path: str | None = None) -> MeasuredChoice:
  """Measures the candidates for ``fn(*args, **kwargs)`` (see the module docstring)."""
  if steps < 1 or repeats < 1 or warmup < 1 or not 0 <= margin < 1:
    raise errors.ConfigurationError(
        f"cuda_graphs='measure': steps={steps}, repeats={repeats}, warmup={warmup} must be >= 1 "
        f"and margin={margin} in [0, 1).")
  fp = fingerprint(default_compiled)
  if fp in _CACHE:
    return dataclasses.replace(_CACHE[fp], cached=True, cost_s=0.0)
  stored = _load(cache_path)
  if fp in stored:
    _CACHE[fp] = _from_json(fp, stored[fp])
    return _CACHE[fp]
  t0 = time.perf_counter()
  module = hlo.read_compiled(default_compiled)
  trips = module.trip_counts()
  cands = candidates(module, trips)
  default = gp.CudaGraphPolicy.from_mode("measure")
  described = {BASELINE: default.describe(), **{k: v.describe() for k, v in cands.items()}}
  if not cands:
    choice = MeasuredChoice(default, fp, {}, {}, described,
                            "no policy is predicted to launch differently from XLA's defaults: "
                            "nothing to measure", time.perf_counter() - t0)
  else:
    kw = {k: v for k, v in jit_kwargs.items() if k not in ("donate_argnums", "donate_argnames")}
    fns = {BASELINE: jax.jit(fn, compiler_options=dict(user_options) or None, **kw)}
    for name, policy in cands.items():
      fns[name] = jax.jit(fn, compiler_options={**user_options, **gp.options_for(policy)}, **kw)
    for f in fns.values():           # compile and warm up every candidate first
      for _ in range(warmup):
        jax.block_until_ready(f(*args, **kwargs))
    per_repeat: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
      for name in names[r % len(names):] + names[:r % len(names)]:
        f = fns[name]
        t1 = time.perf_counter()
        out = None
        for _ in range(steps):
          out = f(*args, **kwargs)
        jax.block_until_ready(out)
        per_repeat[name].append((time.perf_counter() - t1) / steps)
    winner, why = choose(per_repeat, margin)
    policy = default if winner == BASELINE else cands[winner]
    choice = MeasuredChoice(policy, fp, {k: statistics.median(v) for k, v in per_repeat.items()},
                            per_repeat, described, why, time.perf_counter() - t0)
  _CACHE[fp] = choice
  if cache_path:
    stored[fp] = choice.to_dict()
    tmp = f"{cache_path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(stored, f, indent=1)
    os.replace(tmp, cache_path)
  return choice
