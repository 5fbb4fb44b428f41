"""What is live at the peak of an XLA buffer assignment's temp buffer, read from a dump alone.

XLA's dump (``--xla_dump_to=DIR``) of a compiled step holds its optimized HLO (the schedule: each
computation's instructions in order) and its buffer assignment (every value's allocation, offset
and size, and each value's positions and uses). This script flattens the schedule as XLA's
HloLiveRange does (a while loop's condition and body in place before the loop, a call's and an
async start's computations before the instruction), gives each value of the preallocated temp
buffer a live range (its first position to its last use; a value at a nested computation's
parameter or root lives through that computation), merges the values that share one buffer (same
offset, overlapping ranges) and sums the buffers live at each step. Where the peak of that sum is
the temp buffer's size, the temp is the live values, not fragmentation of the heap; the values
live there say why it has the size it has.

Usage: python3 scripts/xla_dump_peak.py DIR [DIR ...] [--json OUT] (DIR holds one module's
``*after_optimizations.txt``, ``*-buffer-assignment.txt`` and ``*-buffer-assignment-values.txt``).
"""

import argparse
import glob
import json
import re

_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$")
_COMP = re.compile(r"^(ENTRY )?%([\w.\-]+) \(")
_VALUE = re.compile(r" value: <(\d+) (\S+?)(?:\{[\d,]*\})?(?: \(phi\))? @0> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)")


def _computations(lines):
  """{name: [(instruction, text)]} in schedule order, and the entry's name."""
  comps, cur, entry = {}, None, None
  for line in lines:
    m = _COMP.match(line)
    if m and line.rstrip().endswith("{"):
      cur = m.group(2)
      comps[cur] = []
      entry = cur if m.group(1) else entry
      continue
    m = _INSTR.match(line)
    if m and cur:
      comps[cur].append((m.group(1), m.group(2)))
  return comps, entry


def _flatten(comps, entry):
  """(time of each instruction, [(computation, instruction)], {computation: (first, end)})."""
  time, seq, span = {}, [], {}

  def walk(c):
    first = len(seq)
    for name, text in comps[c]:
      if " while(" in text:
        walk(re.search(r"condition=%([\w.\-]+)", text).group(1))
        walk(re.search(r"body=%([\w.\-]+)", text).group(1))
      elif re.search(r" (call|conditional|[\w\-]+-start)\(", text):
        for called in re.findall(r"(?:calls|branch_computations)=\{?%([\w.\-]+)", text):
          if called in comps:
            walk(called)
      time[name] = len(seq)
      seq.append((c, name))
    span[c] = (first, len(seq))

  walk(entry)
  return time, seq, span


def peak(directory: str) -> dict:
  """The temp buffer's size, the peak of its live bytes, where, and the buffers live there."""
  prefix = glob.glob(f"{directory}/*after_optimizations.txt")[0][:-len(".txt")]
  with open(prefix + ".txt") as f:
    comps, entry = _computations(f.read().split("\n"))
  time, seq, span = _flatten(comps, entry)
  where = {n: c for c, instrs in comps.items() for n, _ in instrs}
  params = {n for instrs in comps.values() for n, text in instrs if " parameter(" in text}
  roots = {instrs[-1][0] for instrs in comps.values() if instrs}
  values, in_temp = [], False
  with open(prefix + "-buffer-assignment.txt") as f:
    for line in f:
      if line.startswith("allocation"):
        in_temp = "preallocated-temp" in line
        continue
      m = _VALUE.match(line)
      if m and in_temp:
        values.append((int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)),
                       m.group(5)))
  with open(prefix + "-buffer-assignment-values.txt") as f:
    text = f.read()
  info = {}
  for block in re.split(r"\n(?=<\d+ )", text):
    m = re.match(r"<(\d+) .*?\n positions:\n(.*?)\n uses:\n(.*?)\n from instruction", block, re.S)
    if m:
      info[int(m.group(1))] = ([p.split()[0] for p in m.group(2).split("\n")],
                               [u.split(",")[0].strip() for u in m.group(3).split("\n")
                                if "(none)" not in u])
  ranges = []
  for vid, name, size, offset, shape in values:
    positions, uses = info[vid]
    times = [time[p] for p in positions if p in time]
    start, end = min(times), max(times + [time[u] for u in uses if u in time])
    for p in positions:
      c = where.get(p)
      if c and c != entry and (p in params or p in roots):
        start, end = min(start, span[c][0]), max(end, span[c][1])
    ranges.append((offset, start, end, size, name, shape))
  buffers = []          # values at one offset with overlapping ranges share one buffer
  for offset, start, end, size, name, shape in sorted(ranges):
    b = buffers[-1] if buffers else None
    if b and b["offset"] == offset and start <= b["end"]:
      b["end"] = max(b["end"], end)
      if size > b["bytes"]:
        b.update(bytes=size, shape=shape)
      b["values"].append(name)
    else:
      buffers.append({"offset": offset, "start": start, "end": end, "bytes": size,
                      "shape": shape, "values": [name]})
  live = [0] * (len(seq) + 1)
  for b in buffers:
    live[b["start"]] += b["bytes"]
    live[b["end"] + 1] -= b["bytes"]
  total, best, at = 0, -1, 0
  for t in range(len(seq)):
    total += live[t]
    if total > best:
      best, at = total, t
  held = sorted((b for b in buffers if b["start"] <= at <= b["end"]), key=lambda b: -b["bytes"])
  return {"dump": directory, "temp_mib": max(o + s for o, _, _, s, _, _ in ranges) / 2**20,
          "peak_live_mib": best / 2**20, "at": list(seq[at]),
          "live_at_peak": [{"mib": b["bytes"] / 2**20, "shape": b["shape"].split("{")[0],
                            "values": b["values"][:4], "from": list(seq[b["start"]]),
                            "to": list(seq[b["end"]])}
                           for b in held if b["bytes"] >= 2**20]}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("dirs", nargs="+")
  ap.add_argument("--json", metavar="PATH")
  a = ap.parse_args()
  out = [peak(d) for d in a.dirs]
  for r in out:
    print(f"{r['dump']}: temp {r['temp_mib']:.1f} MiB, peak of live values {r['peak_live_mib']:.1f}"
          f" MiB at {r['at'][0]}/{r['at'][1]}")
    for b in r["live_at_peak"]:
      print(f"  {b['mib']:7.1f} MiB {b['shape']:24s} {b['values'][0]:36s} "
            f"{b['from'][1]} .. {b['to'][1]}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
