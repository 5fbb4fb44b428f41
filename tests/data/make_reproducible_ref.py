"""Writes tests/data/reproducible_ref.npz: contributions and their contract-v2 sums, from the
independent numpy reference (tests/fixed_point_ref.py), never from dtenjax.

  python tests/data/make_reproducible_ref.py

Arrays (8 contributions x 1024 elements; split them over 1, 2, 4 or 8 devices in order):
  x_float32 [8, 1024] float32        x_bfloat16 [8, 1024] uint16 (bfloat16 bits)
  sum_float32, mean_float32 [1024] uint32 bits;  sum_bfloat16, mean_bfloat16 [1024] uint16 bits
mean = the float32 decode divided by 8 (float32, round to nearest even), then rounded once.
The GPU suite all-reduces the contributions with reproducible=True and compares bits.
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import fixed_point_ref as ref  # noqa: E402


def main() -> None:
  x32 = ref.contributions(8, 1024, seed=2026)
  xbf = x32.astype(ref.BF16)
  out = {"x_float32": x32, "x_bfloat16": xbf.view(np.uint16)}
  for name, x in (("float32", x32), ("bfloat16", xbf)):
    out[f"sum_{name}"] = ref.bits(ref.reproducible_sum(x))
    out[f"mean_{name}"] = ref.bits(ref.reproducible_sum(x, mean=True))
  path = pathlib.Path(__file__).parent / "reproducible_ref.npz"
  np.savez_compressed(path, **out)
  print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
  main()
