"""Writes the stored reference bits of the reproducible sums, from the independent numpy
references (tests/fixed_point_ref.py), never from dtenjax:

  python tests/data/make_reproducible_ref.py

reproducible_v3_ref.npz -- contract v3 (``reproducible=True``):
  x_float32 [8, 1024] float32, x_bfloat16 [8, 1024] uint16 (bfloat16 bits): 8 contributions,
  split them over 1, 2, 4 or 8 devices in order;
  {sum,mean}_{float32,bfloat16}_{w} for w = 1..8: the bits of the first w contributions' sum and
  mean (uint32 / uint16), so the NVLink kernels with w simulated ranks are checked too;
  wide_float32 [40, 256] float32 and {sum,mean}_wide_{w} for w in (16, 32, 33, 40): 33 and 40
  contributions are past one word per value, where reproducible=True runs the exact contract.
reproducible_ref.npz -- contract v2 (``reproducible="exact"``): x_float32, x_bfloat16 as above
  (the same values) and {sum,mean}_{float32,bfloat16} of all 8.
mean = the float32 sum divided by the contribution count (float32, round to nearest even), then
rounded once to the dtype.
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import fixed_point_ref as ref

WIDE = (16, 32, 33, 40)


def main() -> None:
  here = pathlib.Path(__file__).parent
  x32 = ref.contributions(8, 1024, seed=2026)
  xbf = x32.astype(ref.BF16)
  v2 = {"x_float32": x32, "x_bfloat16": xbf.view(np.uint16)}
  v3 = dict(v2)
  for name, x in (("float32", x32), ("bfloat16", xbf)):
    v2[f"sum_{name}"] = ref.bits(ref.exact_sum(x))
    v2[f"mean_{name}"] = ref.bits(ref.exact_sum(x, mean=True))
    for w in range(1, 9):
      v3[f"sum_{name}_{w}"] = ref.bits(ref.v3_sum(x[:w]))
      v3[f"mean_{name}_{w}"] = ref.bits(ref.v3_sum(x[:w], mean=True))
  wide = ref.contributions(40, 256, seed=2027)
  v3["wide_float32"] = wide
  for w in WIDE:
    v3[f"sum_wide_{w}"] = ref.bits(ref.v3_sum(wide[:w]))
    v3[f"mean_wide_{w}"] = ref.bits(ref.v3_sum(wide[:w], mean=True))
  for fname, arrays in (("reproducible_ref.npz", v2), ("reproducible_v3_ref.npz", v3)):
    path = here / fname
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
  main()
