"""Topology.calibrate() and what the planner prices with it (dtenjax/_src/topology/calibrate.py,
the Calibration record in topology/parts.py, pricing/costmodel.calibrated_time) and the
uncalibrated CPU priors (devices that share the host's cores)."""

import dataclasses
import json
import pathlib
import sys

import pytest

import dtenjax
from dtenjax._src import errors
from dtenjax._src.pricing import costmodel
from dtenjax._src.topology.model import Calibration
from dtenjax._src.topology.model import DeviceInfo
from dtenjax._src.topology.model import NumaNode
from dtenjax._src.topology.model import Topology
from dtenjax._src.topology.model import uniform

ROOT = pathlib.Path(__file__).resolve().parents[1]
MiB = 1 << 20

# A made-up calibration: 4 GFLOP/s and 2 GB/s per device; an all-reduce of 1 MiB takes 3 ms and
# of 9 MiB 43 ms (5 ms per MiB between them); an all-gather of 1 MiB 1 ms.
CAL = Calibration(platform="cpu", devices=8, cores=2, matmul_flops=4e9, memory_gbps=2.0,
                  collectives=(("all_reduce", ((MiB, 3e-3), (9 * MiB, 43e-3))),
                               ("all_gather", ((MiB, 1e-3),))),
                  latency_s=2e-3)


def _cpu_host(n=8, cpus="0-1", hosts=1):
  devices = [DeviceInfo(id=i, platform="cpu", kind="cpu", memory_bytes=0, process_index=0,
                        host=f"h{i * hosts // n}") for i in range(n)]
  numa = [NumaNode(host=f"h{h}", id=0, cpus=cpus) for h in range(hosts)]
  return uniform("cpu8", devices, intra="shared_memory", numa_nodes=numa)


def test_the_cpu_prior_divides_the_cores_among_the_devices():
  """8 CPU devices of one process on 2 cores: each computes at 2/8 of the table's per-core rate
  (the table's CPU figure is one core's, 5e10 FLOP/s); a GPU topology is not scaled."""
  assert _cpu_host(8, "0-1").peak_flops() == pytest.approx(5e10 * 2 / 8)
  assert _cpu_host(8, "0-3,8-11").peak_flops() == pytest.approx(5e10 * 8 / 8)
  assert _cpu_host(2, "0-15").peak_flops() == pytest.approx(5e10)       # never above one core each
  assert Topology.fixture("h200_8").peak_flops() == pytest.approx(989e12)
  assert "8 CPU devices sharing 2 cores" in _cpu_host().pricing_summary()


def test_collective_times_interpolate_between_the_measured_sizes():
  ar = lambda n: CAL.collective_s("all_reduce", n)
  assert ar(MiB) == pytest.approx(3e-3) and ar(9 * MiB) == pytest.approx(43e-3)
  assert ar(5 * MiB) == pytest.approx(23e-3)               # halfway
  assert ar(1024) == pytest.approx(3e-3)                   # below the smallest: its time
  assert ar(13 * MiB) == pytest.approx(63e-3)              # beyond: the last slope
  assert CAL.collective_s("all_gather", 3 * MiB) == pytest.approx(3e-3)   # one point: linear
  assert CAL.collective_s("reduce_scatter", MiB) is None


def test_the_cost_model_prices_xla_collectives_on_the_calibrated_host_only():
  one = dataclasses.replace(_cpu_host(), calibration=CAL)
  group = list(range(8))
  assert costmodel.collective_time("all_reduce", 5 * MiB, group, one) == pytest.approx(23e-3)
  assert costmodel.collective_time("all_gather", MiB, group[:4], one) == pytest.approx(1e-3)
  # a record's own formulas, a kind not measured and a group across hosts keep the formulas
  two = dataclasses.replace(_cpu_host(8, hosts=2), calibration=CAL)
  formula = costmodel.collective_time("all_reduce", 5 * MiB, group, _cpu_host(8, hosts=2))
  assert costmodel.collective_time("all_reduce", 5 * MiB, group, two) == formula
  assert costmodel.collective_time("ppermute", MiB, group, one) == \
      costmodel.collective_time("ppermute", MiB, group, _cpu_host())


def test_a_calibration_is_an_input_saved_with_the_topology_and_checked():
  topo = dataclasses.replace(_cpu_host(), calibration=CAL)
  again = Topology.from_json(topo.to_json())
  assert again == topo and again.calibration == CAL and hash(again) == hash(topo)
  assert topo.peak_flops() == 4e9
  assert topo.local_s_per_byte(1.0) == pytest.approx(1 / 2e9)
  data = json.loads(topo.to_json())
  data["calibration"]["collectives"]["all_reduce"] = [[9 * MiB, 0.04], [MiB, 0.003]]
  with pytest.raises(errors.TopologyError, match="(?s)'calibration' is invalid.*ascending"):
    Topology.from_dict(data)
  with pytest.raises(errors.TopologyError, match="matmul_flops"):
    dataclasses.replace(CAL, matmul_flops=0.0)


def _small_step():
  sys.path.insert(0, str(ROOT / "bench"))
  import _families  # pylint: disable=g-import-not-at-top
  return _families


def test_the_plan_prices_with_the_calibration_and_prints_it(cpu_devices):
  """A calibration changes the price (here compute 4 GFLOP/s against the prior's 12.5) and the
  report names it."""
  del cpu_devices
  fams = _small_step()
  step, args = fams.FAMILIES["llama_loop"](vocab=256, d=64, heads=4, ffn=128, layers=2, batch=8,
                                           seq=32).make()
  topo = Topology.current()
  cal = dataclasses.replace(topo, calibration=dataclasses.replace(CAL, devices=topo.num_devices))
  a, prior = dtenjax.plan(step, *args, topology=cal), dtenjax.plan(step, *args, topology=topo)
  assert a.cost.compute_s > prior.cost.compute_s
  assert "calibrated on 8 cpu devices sharing 2 cores: 4.0 GFLOP/s" in str(a)
  assert "table priors" in str(prior)


def test_calibrate_measures_the_devices_working_together(cpu_devices):
  """A real, tiny measurement on the 8 CPU devices: every field measured and positive."""
  del cpu_devices
  topo = Topology.current().calibrate(
      repeats=1, chain=1, sizes={"matmul": ((64, 64, 64),), "memory": 64 << 10,
                                 "collectives": (64 << 10,), "latency": 0})
  cal = topo.calibration
  assert cal.platform == "cpu" and cal.devices == 8 and cal.cores >= 1
  assert cal.matmul_flops > 0 and cal.memory_gbps > 0 and cal.latency_s == 0   # not asked
  assert [k for k, _ in cal.collectives] == ["all_reduce", "all_gather", "reduce_scatter"]
  for _, pts in cal.collectives:
    assert [b for b, _ in pts] == [64 << 10] and pts[0][1] > 0
  assert topo.notes[-1] == cal.summary()
  with pytest.raises(errors.ConfigurationError, match="repeats"):
    Topology.current().calibrate(repeats=0)


# Measured on 8 CPU devices of the 2-core VM, 2026-12-05 (docs/benchmarks.md, "The plan against
# the layouts a user writes"): the hand-written DP step against the hand-written FSDP step.
# llama_scan 640 / 900 ms, llama_loop 514 / 674 ms, moe 285 / 261 ms.
MEASURED_DP_VS_FSDP = {"llama_scan": "DP", "llama_loop": "DP", "moe": "FSDP"}


@pytest.mark.parametrize("family", sorted(MEASURED_DP_VS_FSDP))
def test_dp_against_fsdp_ranks_as_measured_on_8_cpu_devices(family, cpu_devices):
  """The model (table priors of this 2-core host's 8 devices) prices the planner's DP and FSDP
  layouts in the order the hand-written ones ran: where 54-84 per-layer all-gathers cost more
  than DP's optimizer update over whole copies (the decoders), DP; where DP's update of the
  experts' weights is the larger cost (moe), FSDP."""
  del cpu_devices
  fams = _small_step()
  step, args = fams.FAMILIES[family]().make()
  topo = _cpu_host(8, "0-1")
  recipes = {r.name: r.cost.total_s for r in dtenjax.plan(step, *args, topology=topo).recipes}
  faster = "DP" if recipes["DP"] < recipes["FSDP"] else "FSDP"
  assert faster == MEASURED_DP_VS_FSDP[family], recipes
