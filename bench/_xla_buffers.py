"""XLA:CPU's buffer assignment of a compiled step, read from its ``--xla_dump_to`` files: where
each value went (an output's allocation or the temporary heap) and why.

XLA's ``BufferAssigner`` (xla/service/buffer_assignment.cc) sorts the step's buffers by size,
largest first (ties: a live-out buffer first, then the lower post-order position, then the lower
id). A live-out buffer gets an allocation of its own; any other buffer first tries an operand's
allocation, then the allocations made so far from the most recently made (the smallest) to the
first, and takes the first one none of whose values interferes with it (their live ranges in
the schedule overlap; ``MaybeAssignBuffer``); with none free it is deferred to the heap
simulator (the ``preallocated-temp`` allocation, XLA's temp). So a small value that lives long
(a constant broadcast in the forward and read in the backward) is a heap buffer exactly where
every output's allocation of at least its size holds a larger value, or a value of its size
placed before it, somewhere over its range. :func:`at_turn` reads that from the dump.

Used by docs/benchmarks.md's heap19 and heap27 sections (the fourth slot of a sliced loss's
vocabulary chain, dtenjax/_src/planning/heapslot.py): compile a step with
``--xla_dump_to=DIR`` and run ``python bench/_xla_buffers.py DIR`` (the labels' scatter's
updates and indices, the loss's partial sum, the vocabulary weight gradient; ``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys


@dataclasses.dataclass
class Allocation:
  index: int
  size: int
  flags: str                                   # "maybe-live-out", "preallocated-temp", ...
  values: list[tuple[str, int]]                # (value name, bytes)

  @property
  def heap(self) -> bool:
    return "preallocated-temp" in self.flags

  @property
  def output(self) -> bool:
    """A live-out allocation a value may share: not a parameter's, not the output tuple's."""
    return ("maybe-live-out" in self.flags and "parameter" not in self.flags and
            "output shape" not in self.flags)


@dataclasses.dataclass
class Dump:
  allocations: list[Allocation]
  ranges: dict[str, tuple[int, int]]           # value name -> (first, last) in the schedule
  sequence: list[str]                          # the whole module's schedule, flattened
  entry: dict[str, tuple[str, str, list[str], str]]   # name -> (shape, opcode, operands, line)

  def allocation_of(self, name: str) -> Allocation | None:
    return next((a for a in self.allocations if any(n == name for n, _ in a.values)), None)

  def size_of(self, name: str) -> int:
    a = self.allocation_of(name)
    return next(sz for n, sz in a.values if n == name)

  def position(self, name: str) -> int | None:
    return self.sequence.index(name) if name in self.sequence else None


def _largest(directory: str, suffix: str) -> str:
  """The dump's file of the step (the largest module of that suffix: the jitted step, not the
  small programs jax compiles beside it)."""
  names = [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(suffix)]
  if not names:
    raise FileNotFoundError(f"no *{suffix} in {directory}: compile with --xla_dump_to={directory}")
  return max(names, key=os.path.getsize)


def parse(assignment: str, live_range: str, hlo: str) -> Dump:
  """A :class:`Dump` from the texts of ``*-buffer-assignment.txt``, ``*-live-range.txt`` and
  the optimized HLO (``*cpu_after_optimizations.txt``)."""
  allocations: list[Allocation] = []
  for line in assignment.splitlines():
    if line.startswith("Total bytes used") or line.startswith("Used values"):
      break
    m = re.match(r"allocation (\d+): size (\d+), (.*?):?$", line)
    if m:
      allocations.append(Allocation(int(m[1]), int(m[2]), m[3], []))
      continue
    m = re.match(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\)", line)
    if m and allocations:
      allocations[-1].values.append((m[1], int(m[2])))
  ranges, sequence = {}, []
  for line in live_range.splitlines():
    m = re.match(r"\s+(\d+):(\S+)$", line)
    if m:
      sequence.append(m[2])
      continue
    m = re.match(r"\s+(\S+?)(\{[^}]*\})?:(\d+)-(\d+)$", line)
    if m:
      ranges[m[1] if (m[2] or "{}") == "{}" else m[1] + m[2]] = (int(m[3]), int(m[4]))
  entry = {}
  body = hlo.split("\nENTRY ", 1)[-1]
  for line in body.splitlines():
    m = re.match(r"\s+(?:ROOT )?%(\S+) = (\S+) ([\w-]+)\((.*?)\)", line)
    if m:
      entry[m[1]] = (m[2], m[3], re.findall(r"%([\w.\-]+)", m[4]), line)
  return Dump(allocations, ranges, sequence, entry)


def read(directory: str) -> Dump:
  """The jitted step's :class:`Dump` from an ``--xla_dump_to`` directory."""
  texts = [open(_largest(directory, s)).read() for s in (
      "cpu_after_optimizations-buffer-assignment.txt", "cpu_after_optimizations-live-range.txt",
      "cpu_after_optimizations.txt")]
  return parse(*texts)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
  return not (a[1] < b[0] or a[0] > b[1])


def at_turn(dump: Dump, name: str) -> dict:
  """Where XLA put ``name`` and the outputs' allocations it could have taken at its turn:
  ``free`` the allocations of at least its size that no larger value holds over its range,
  each with the values of its size that hold it there (placed before it: a lower post-order
  position); ``open`` those no value of at least its size holds; ``placed`` "heap" or the
  allocation's index; ``smallest_first``: whether XLA's rule gives that placement (the heap
  where ``open`` is empty, else the most recently made of ``open``)."""
  a = dump.allocation_of(name)
  size, span = dump.size_of(name), dump.ranges[name]
  free, open_ = [], []
  for b in dump.allocations:
    if not b.output or b.size < size or max(sz for _, sz in b.values) < size:
      continue                # (an allocation first made for a smaller value came after it)
    over = [(n, sz) for n, sz in b.values
            if n != name and n in dump.ranges and _overlaps(dump.ranges[n], span)]
    if not any(sz > size for _, sz in over):
      same = [n for n, sz in over if sz == size]
      free.append((b.index, same))
      if not same:
        open_.append(b.index)
  placed = "heap" if a.heap else a.index
  ok = placed == "heap" and not open_ or placed != "heap" and open_ and placed == max(open_)
  return {"value": name, "bytes": size, "range": list(span), "placed": placed,
          "outputs_of_its_size": sum(1 for b in dump.allocations if b.output and b.size >= size),
          "free": free, "open": open_, "smallest_first": bool(ok)}


def loss_chain(dump: Dump) -> dict:
  """The sliced loss's small values in the step's program: the labels' scatter into the
  ``[b, s-1, V]`` gradient (``take_along_axis``'s backward) and its updates and indices, the
  loss's partial sums (scalar ``reduce_sum`` fusions between the softmax's ``exp`` and the
  scatter), and the products reading the pad of the slice's backward (``[b·s, V]``)."""
  def rank(shape):
    return shape.split("{")[0].count(",") + 1
  scatters = [n for n, (shape, op, ops, line) in dump.entry.items()
              if "take_along_axis)/scatter-add" in line and op == "fusion" and rank(shape) == 3
              and len(ops) == 3 and n in dump.sequence]
  if not scatters:
    raise ValueError("no take_along_axis scatter-add of rank 3 in the step's entry computation")
  scatter = min(scatters, key=dump.sequence.index)
  grad, indices, updates = dump.entry[scatter][2]
  exp = min(dump.sequence.index(n) for n, (shape, _, _, line) in dump.entry.items()
            if 'op_name="jit(step)/exp"' in line and rank(shape) == 3 and n in dump.sequence)
  sums = [n for n in dump.sequence[exp:dump.sequence.index(scatter) + 1]
          if n in dump.entry and dump.entry[n][0].startswith("f32[]")
          and "reduce_sum" in dump.entry[n][3]]
  products = []
  pads = [n for n, (shape, _, _, line) in dump.entry.items()
          if 'op_name="jit(step)/pad"' in line and rank(shape) == 2 and n in dump.sequence]
  for pad in pads:
    readers = [n for n, (_, _, ops, _) in dump.entry.items() if pad in ops]
    for r in readers:
      if "copy" in r or "bitcast" in r:    # the pad's transposed copy: its reader is the product
        readers += [n for n, (_, _, ops, _) in dump.entry.items() if r in ops]
    for r in readers:
      if "copy" in r or "bitcast" in r or r not in dump.ranges:
        continue
      a = dump.allocation_of(r)
      products.append({"value": r, "shape": dump.entry[r][0], "range": list(dump.ranges[r]),
                       "placed": "heap" if a.heap else a.index})
  return {"scatter": scatter, "updates": at_turn(dump, updates),
          "indices": at_turn(dump, indices), "partial_sums": [at_turn(dump, s) for s in sums],
          "products_of_the_pad": products}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("dump", help="an --xla_dump_to directory of one compiled step")
  ap.add_argument("--json", action="store_true", help="print loss_chain's dict as JSON")
  args = ap.parse_args(argv)
  chain = loss_chain(read(args.dump))
  if args.json:
    print(json.dumps(chain, indent=1))
    return 0
  for what in ("updates", "indices"):
    v = chain[what]
    print(f"{what}: {v['value']} {v['bytes']} B {v['range']} -> {v['placed']}; outputs of its "
          f"size {v['outputs_of_its_size']}, free of larger values {v['free']}, "
          f"XLA's rule {'holds' if v['smallest_first'] else 'does NOT hold'}")
  for v in chain["partial_sums"]:
    print(f"partial sum: {v['value']} {v['range']} -> {v['placed']}; free of larger values "
          f"{len(v['free'])}, open {v['open'][-5:]}, "
          f"XLA's rule {'holds' if v['smallest_first'] else 'does NOT hold'}")
  for p in chain["products_of_the_pad"]:
    print(f"product of the pad: {p['value']} {p['shape']} {p['range']} -> {p['placed']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
