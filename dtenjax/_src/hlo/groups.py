"""Replica groups in XLA's compact forms, expanded to explicit groups of logical ids: an iota list
(reshape, transpose, split into groups) and mesh axes (a named mesh and the axes the collective
spans, printed as ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtenjax._src.hlo.records import HloReadError


def iota_groups(num_groups: int, group_size: int, reshape_dims: Sequence[int],
                transpose_perm: Sequence[int] = ()) -> tuple[tuple[int, ...], ...]:
  """``[num_groups, group_size] <= [reshape_dims] T(transpose_perm)`` as explicit groups."""
  dims = [int(d) for d in reshape_dims]
  ids = np.arange(int(np.prod(dims)) if dims else 0).reshape(dims)
  if transpose_perm:
    ids = ids.transpose([int(p) for p in transpose_perm])
  if ids.size != num_groups * group_size:
    raise HloReadError(
        f"iota replica groups [{num_groups},{group_size}]<={dims}: {ids.size} ids do not fill "
        f"{num_groups} groups of {group_size}")
  return tuple(tuple(int(v) for v in row) for row in ids.reshape(num_groups, group_size))


def mesh_axes_groups(axis_sizes: Sequence[int], device_ids: Sequence[int],
                     axes: Sequence[tuple[int, tuple[int, int] | None]]
                     ) -> tuple[tuple[int, ...], ...]:
  """Groups of a mesh-axes replica list: devices that differ only along ``axes``.

  Args:
    axis_sizes: the mesh's axis sizes, major to minor.
    device_ids: the mesh's devices in row-major order (empty: iota).
    axes: ``(mesh axis index, sub-axis)`` per axis the collective spans, in group order; a
      sub-axis ``(pre_size, size)`` is the ``size``-long slice of its axis after ``pre_size``.

  The device array is reshaped to the axis sizes (a sub-axis splits its axis into
  ``[pre_size, size, rest]``), the spanned dimensions are moved last in the order given, and
  consecutive runs of the group size are the groups.
  """
  sizes = [int(s) for s in axis_sizes]
  total = int(np.prod(sizes)) if sizes else 1
  devices = np.asarray(list(device_ids) if device_ids else range(total), dtype=np.int64)
  if devices.size != total:
    raise HloReadError(f"mesh axes {sizes} hold {total} devices but device_ids lists "
                       f"{devices.size}")
  by_axis: dict[int, list[tuple[int, tuple[int, int] | None]]] = {}
  for pos, (idx, sub) in enumerate(axes):
    if not 0 <= idx < len(sizes):
      raise HloReadError(f"replica groups name mesh axis {idx}; the mesh has {len(sizes)} axes")
    by_axis.setdefault(idx, []).append((pos, sub))
  new_dims: list[int] = []
  grouped: dict[int, int] = {}     # position in `axes` -> dimension of the reshaped array
  for idx, size in enumerate(sizes):
    refs = by_axis.get(idx)
    if not refs:
      new_dims.append(size)
      continue
    if len(refs) == 1 and refs[0][1] is None:
      grouped[refs[0][0]] = len(new_dims)
      new_dims.append(size)
      continue
    if any(sub is None for _, sub in refs):
      raise HloReadError(f"mesh axis {idx} is named whole and as a sub-axis in one group list")
    prefix = 1
    for pos, (pre, sz) in sorted(refs, key=lambda r: r[1][0]):
      if pre % prefix:
        raise HloReadError(f"sub-axis ({pre}){sz} of mesh axis {idx} overlaps another")
      if pre != prefix:
        new_dims.append(pre // prefix)
        prefix = pre
      grouped[pos] = len(new_dims)
      new_dims.append(sz)
      prefix *= sz
    if size % prefix:
      raise HloReadError(f"sub-axes of mesh axis {idx} (size {size}) do not divide it")
    if prefix != size:
      new_dims.append(size // prefix)
  order = [grouped[p] for p in range(len(axes))]
  rest = [d for d in range(len(new_dims)) if d not in order]
  arr = devices.reshape(new_dims).transpose(rest + order)
  group_size = int(np.prod([new_dims[d] for d in order])) if order else 1
  return tuple(tuple(int(v) for v in row) for row in arr.reshape(-1, group_size))
