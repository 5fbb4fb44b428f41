"""Tests of dtenjax._src.topology.model, detect and probe: fixtures, JSON, validation, groupings."""

import json
import pickle

import pytest

from dtenjax._src import errors
from dtenjax._src.topology import model as topo
from dtenjax._src.topology.model import DeviceInfo, LinkSpec, Topology


def _dev(i, host="h0", numa=0, platform="gpu", kind="NVIDIA A100-SXM4-80GB"):
  return DeviceInfo(id=i, platform=platform, kind=kind, memory_bytes=80 << 30,
                    process_index=i, host=host, numa_node=numa, local_index=i)


# --- fixtures -------------------------------------------------------------------------------


def test_fixture_names():
  assert Topology.fixtures() == ("dgx_a100_8", "h100_1024", "h100_16", "h100_256", "h100_64",
                                 "h200_8", "pcie_8", "roce_a100_4x8")


@pytest.mark.parametrize("name,hosts", [("h100_16", 2), ("h100_64", 8), ("h100_256", 32)])
def test_generated_clusters_are_hosts_of_8_nvswitch_gpus_over_infiniband(name, hosts):
  t = Topology.fixture(name)
  assert t.num_devices == 8 * hosts and len(t.hosts()) == hosts
  assert t.link_class(0, 7) == "nvswitch" and t.link_class(0, 8) == "infiniband"
  assert t.spec("infiniband").bandwidth_gbps == 50.0        # 400 Gb/s per NIC, one per GPU
  assert t.fast_islands() == tuple(tuple(range(h * 8, h * 8 + 8)) for h in range(hosts))
  assert Topology.from_json(t.to_json()) == t


def test_probed_link_classes_are_recorded_and_survive_json():
  t = Topology.fixture("h100_16").with_links({"infiniband": LinkSpec(10.0, 5.0)})
  assert t.measured == ("infiniband",)
  again = Topology.from_json(t.to_json())
  assert again.measured == ("infiniband",) and again.spec("infiniband").bandwidth_gbps == 10.0
  assert t.with_links({"infiniband": LinkSpec(50.0, 3.0)}, measured=False).measured == ()


def test_dgx_a100_fixture_matches_seed():
  t = Topology.fixture("dgx_a100_8")
  assert t.num_devices == 8
  assert {d.kind for d in t.devices} == {"NVIDIA A100-SXM4-80GB"}
  assert len(t.hosts()) == 1
  classes = {t.link_class(a, b) for a in t.device_ids for b in t.device_ids if a != b}
  assert classes == {"nvlink"}
  assert t.spec("nvlink").bandwidth_gbps >= 200      # per direction, seed says >= 200 GB/s
  assert t.fast_islands() == (tuple(range(8)),)


def test_roce_fixture_matches_seed():
  t = Topology.fixture("roce_a100_4x8")
  assert t.num_devices == 32
  assert t.hosts() == tuple(tuple(range(h * 8, h * 8 + 8)) for h in range(4))
  assert t.link_class(0, 7) == "nvlink"
  assert t.link_class(0, 8) == "roce"
  assert t.link_class(31, 3) == "roce"
  roce = t.spec("roce")
  assert roce.bandwidth_gbps * 8 == pytest.approx(100)     # 100 Gb/s NIC
  assert 2 * roce.latency_us == pytest.approx(10, abs=6)   # RTT "about 5 us": one-way ~2.5-5
  assert roce.latency_us <= 5
  assert len(t.nics) == 16
  assert all(n.link_layer == "Ethernet" and n.bandwidth_gbps * 8 == pytest.approx(100)
             for n in t.nics)
  assert t.fast_islands() == t.hosts()


def test_h200_and_pcie_fixtures():
  h = Topology.fixture("h200_8")
  assert h.link_class(0, 5) == "nvswitch"
  assert h.spec("nvswitch").bandwidth_gbps > h.spec("nvlink").bandwidth_gbps
  p = Topology.fixture("pcie_8")
  # two sockets: GPUs 0-3 on NUMA 0, 4-7 on NUMA 1
  assert p.link_class(0, 3) == "pcie"
  assert p.link_class(0, 4) == "numa_cross"
  assert p.fast_islands() == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert p.slowest_link([0, 1, 5])[0] == "numa_cross"
  assert p.slowest_link([2])[0] == "local"


def test_unknown_fixture_lists_available():
  with pytest.raises(errors.TopologyError, match="dgx_a100_8"):
    Topology.fixture("dgx_a100")


# --- JSON -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dgx_a100_8", "roce_a100_4x8", "h200_8", "pcie_8"])
def test_json_round_trip(name, tmp_path):
  t = Topology.fixture(name)
  assert Topology.from_json(t.to_json()) == t
  path = tmp_path / "t.json"
  path.write_text(t.to_json())
  assert Topology.from_json(path) == t
  assert Topology.from_json(str(path)) == t
  assert hash(Topology.from_json(t.to_json())) == hash(t)


def test_malformed_json_names_position():
  with pytest.raises(errors.TopologyError, match=r"not valid JSON .*line 1, column"):
    Topology.from_json('{"name": "x", ')


def test_missing_file_is_topology_error(tmp_path):
  with pytest.raises(errors.TopologyError, match="cannot read topology file"):
    Topology.from_json(tmp_path / "nope.json")


def test_missing_keys_are_all_listed():
  with pytest.raises(errors.TopologyError) as e:
    Topology.from_json('{"name": "x"}')
  assert "missing key 'devices'" in str(e.value)
  assert "missing key 'link_matrix'" in str(e.value)


def test_not_an_object():
  with pytest.raises(errors.TopologyError, match="expected a JSON object, got list"):
    Topology.from_json("[1, 2]")


def test_bad_device_record_and_unknown_link_class():
  d = Topology.fixture("dgx_a100_8").to_dict()
  del d["devices"][3]["host"]
  d["devices"][5]["colour"] = "red"
  d["links"]["warp_drive"] = {"bandwidth_gbps": 1, "latency_us": 1}
  with pytest.raises(errors.TopologyError) as e:
    Topology.from_dict(d, "t.json")
  msg = str(e.value)
  assert "t.json" in msg
  assert "devices[3] is missing ['host']" in msg
  assert "devices[5] has unknown fields ['colour']" in msg
  assert "unknown class 'warp_drive'" in msg


def test_asymmetric_matrix_named():
  d = Topology.fixture("dgx_a100_8").to_dict()
  d["link_matrix"][2][5] = "pcie"
  with pytest.raises(errors.TopologyError, match=r"not symmetric: \[2\]\[5\] = 'pcie' but "
                     r"\[5\]\[2\] = 'nvlink'"):
    Topology.from_json(json.dumps(d))


def test_matrix_shape_class_and_diagonal_problems():
  devs = (_dev(0), _dev(1))
  with pytest.raises(errors.TopologyError, match="link_matrix must be 2 x 2"):
    Topology("t", devs, (("local", "nvlink"),))
  with pytest.raises(errors.TopologyError, match="'warp' is not a link class"):
    Topology("t", devs, (("local", "warp"), ("warp", "local")))
  with pytest.raises(errors.TopologyError, match="must be 'local'"):
    Topology("t", devs, (("nvlink", "nvlink"), ("nvlink", "local")))
  with pytest.raises(errors.TopologyError, match="not unique"):
    Topology("t", (_dev(0), _dev(0)), (("local", "local"), ("local", "local")))


def test_linkspec_validation():
  with pytest.raises(errors.TopologyError, match="bandwidth must be > 0"):
    LinkSpec(0.0, 1.0)
  s = LinkSpec(12.5, 5.0)
  assert s.alpha == pytest.approx(5e-6)
  assert s.beta == pytest.approx(1 / 12.5e9)


# --- groupings and copies --------------------------------------------------------------------


def test_interleaved_hosts_grouping():
  devs = [_dev(i, host=f"h{i % 2}") for i in range(4)]
  t = topo.uniform("inter", devs, intra="nvlink", inter="roce")
  assert t.hosts() == ((0, 2), (1, 3))
  assert t.islands("nvlink") == ((0, 2), (1, 3))
  assert t.islands("roce") == ((0, 1, 2, 3),)
  assert sorted(t.device_ids, key=t.hierarchy_key) == [0, 2, 1, 3]
  with pytest.raises(errors.TopologyError, match="device id 9 is not in topology"):
    t.link_class(0, 9)


def test_islands_are_the_connected_groups_of_fast_links_on_any_matrix():
  """islands() against a union-find over every pair, on random symmetric matrices whose fast
  links make chains and stars (not only whole hosts), device ids out of order, at every level."""
  import random
  rng = random.Random(7)
  for trial in range(40):
    n = rng.randint(1, 24)
    ids = rng.sample(range(100), n)
    rows = [["tcp"] * n for _ in range(n)]
    for i in range(n):
      rows[i][i] = "local"
      for j in range(i + 1, n):
        rows[i][j] = rows[j][i] = rng.choice(["nvlink", "pcie", "roce", "tcp", "tcp", "tcp"])
    t = Topology(f"random{trial}", tuple(_dev(i) for i in ids), tuple(map(tuple, rows)))
    for level in topo.LINK_ORDER:
      parent = list(range(n))

      def root(a):
        while parent[a] != a:
          a = parent[a]
        return a
      for i in range(n):
        for j in range(n):
          if topo.LINK_ORDER.index(rows[i][j]) <= topo.LINK_ORDER.index(level):
            parent[root(i)] = root(j)
      groups: dict[int, list[int]] = {}
      for i in range(n):
        groups.setdefault(root(i), []).append(ids[i])
      want = tuple(sorted((tuple(g) for g in groups.values()), key=lambda g: ids.index(g[0])))
      assert t.islands(level) == want, (trial, level)


def test_subset_and_with_links():
  t = Topology.fixture("roce_a100_4x8")
  s = t.subset([8, 0, 9])
  assert s.device_ids == (8, 0, 9)
  assert s.link_class(8, 9) == "nvlink" and s.link_class(0, 8) == "roce"
  w = t.with_links({"roce": LinkSpec(50.0, 1.0)}, notes=["measured"])
  assert w.spec("roce") == LinkSpec(50.0, 1.0)
  assert w.spec("nvlink") == t.spec("nvlink")
  assert w.source == "probed" and w.notes[-1] == "measured"
  assert w != t and t.spec("roce").bandwidth_gbps == 12.5
  with pytest.raises(errors.TopologyError, match="unknown link classes"):
    t.with_links({"warp": LinkSpec(1.0, 1.0)})


def test_pickle_drops_memoised_state():
  t = Topology.fixture("dgx_a100_8")
  hash(t)
  t.fast_islands()
  u = pickle.loads(pickle.dumps(t))
  assert u == t and "_hash" not in u.__dict__ and "_derived" not in u.__dict__


def test_current_and_set_current(monkeypatch, tmp_path):
  fx = Topology.fixture("h200_8")
  try:
    topo.set_current(fx)
    assert Topology.current() is fx
    path = tmp_path / "t.json"
    path.write_text(Topology.fixture("pcie_8").to_json())
    monkeypatch.setenv("DTENJAX_TOPOLOGY", str(path))
    topo.set_current(None)
    assert Topology.current().name == "pcie_8"
  finally:
    topo.set_current(None)


# --- detect and probe ------------------------------------------------------------------------


def test_detect_describes_cpu_devices(cpu_devices):
  t = Topology.detect(cpu_devices)
  assert t.source == "detected"
  assert t.device_ids == tuple(d.id for d in cpu_devices)
  assert {d.platform for d in t.devices} == {"cpu"}
  assert len(t.hosts()) == 1
  assert {t.link_class(a, b) for a in t.device_ids for b in t.device_ids if a != b} == {
      "shared_memory"}
  assert t.fast_islands() == (t.device_ids,)
  assert t.numa_nodes and all(n.host == t.devices[0].host for n in t.numa_nodes)
  assert any("no RDMA" in n for n in t.notes)
  assert any("8 CPU devices" in n for n in t.notes)
  assert Topology.from_json(t.to_json()) == t


def test_exchange_through_kvstore():
  from dtenjax._src.topology import detect
  from dtenjax._src.net import kvstore
  # 0.2 s: the in-memory store answers a key that is there at once; the last exchange waits
  # out the whole timeout for a rank that never writes
  store = kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=0.2)
  store.set(store.key("topology-gpus", 1), '{"host": "nodeB", "gpus": {}}')  # another process
  mine = {"host": "nodeA", "gpus": {"0": {"bus": "0000:19:00.0", "numa": 0}}}
  assert detect.exchange("topology-gpus", mine, 0, 2, store) == [
      mine, {"host": "nodeB", "gpus": {}}]
  with pytest.raises(errors.CollectiveTimeoutError, match="topology-gpus/2"):
    detect.exchange("topology-gpus", mine, 0, 3, store)


def test_probe_measures_present_classes_and_keeps_others(cpu_devices):
  t = Topology.detect(cpu_devices)
  # Pretend the devices span two hosts so a class that cannot be measured is present.
  devs = tuple(DeviceInfo(**{**d.__dict__, "host": "a" if i < 4 else "b"})
               for i, d in enumerate(t.devices))
  t2 = topo.uniform("two-hosts", devs, intra="shared_memory", inter="tcp",
                    links={"shared_memory": LinkSpec(123.0, 45.0)})
  p = t2.probe(small_bytes=8, large_bytes=1 << 16, repeats=2)
  assert p.source == "probed"
  assert p.spec("shared_memory") != LinkSpec(123.0, 45.0)
  assert p.spec("local") != t2.spec("local")
  assert p.spec("tcp") == t2.spec("tcp")
  assert any("probed shared_memory" in n for n in p.notes)
  assert any("table values kept: ['tcp']" in n for n in p.notes)
  assert p.link_matrix == t2.link_matrix


def test_probe_refuses_foreign_platform_and_bad_sizes(cpu_devices):
  with pytest.raises(errors.TopologyError, match="none of topology 'dgx_a100_8'"):
    Topology.fixture("dgx_a100_8").probe()
  t = Topology.detect(cpu_devices)
  with pytest.raises(errors.ConfigurationError, match="small_bytes < large_bytes"):
    t.probe(small_bytes=64, large_bytes=8)


def test_inter_host_class_reads_the_link_layer_in_any_spelling():
  from dtenjax._src.topology import detect
  from dtenjax._src.topology.parts import NicInfo
  nic = lambda layer, state="ACTIVE": NicInfo(name="mlx5_0", host="h", link_layer=layer,
                                              state=state, bandwidth_gbps=25.0)
  assert detect.inter_host_class([nic("INFINIBAND")]) == "infiniband"
  assert detect.inter_host_class([nic("infiniband")]) == "infiniband"
  assert detect.inter_host_class([nic("Ethernet")]) == "roce"
  assert detect.inter_host_class([nic("InfiniBand", state="DOWN")]) == "tcp"
  assert detect.inter_host_class([]) == "tcp"


# --- the JSON format: version and schema -----------------------------------------------------------

SCHEMA_FILE = "dtenjax/schemas/topology-1.schema.json"


def _schema():
  import pathlib
  root = pathlib.Path(__file__).resolve().parents[1]
  return json.loads((root / SCHEMA_FILE).read_text())


def test_json_names_its_format_and_old_files_still_read():
  d = Topology.fixture("h200_8").to_dict()
  assert next(iter(d)) == "format" and d["format"] == topo.FORMAT == "dtenjax.topology/1"
  del d["format"]                       # a file saved before formats were versioned
  assert Topology.from_dict(d) == Topology.fixture("h200_8")


def test_other_formats_are_refused_with_the_fix():
  d = Topology.fixture("pcie_8").to_dict()
  with pytest.raises(errors.TopologyError, match=r"format 'dtenjax.topology/2'; this dtenjax "
                     r"reads 'dtenjax.topology/1' \(the file was written by a newer dtenjax"):
    Topology.from_dict({**d, "format": "dtenjax.topology/2"}, "t.json")
  with pytest.raises(errors.TopologyError, match="format 'nccl-topo'"):
    Topology.from_dict({**d, "format": "nccl-topo"}, "t.json")


BROKEN = {   # mutation of a fixture -> what from_dict must say (the JSON Schema refuses each too)
    "device id a string": (lambda d: d["devices"][0].update(id="zero"),
                           "devices[0].id = 'zero' must be a whole number"),
    "bool memory": (lambda d: d["devices"][1].update(memory_bytes=True),
                    "devices[1].memory_bytes = True must be a whole number"),
    "bandwidth a string": (lambda d: d["links"]["pcie"].update(bandwidth_gbps="fast"),
                           "links['pcie'].bandwidth_gbps = 'fast' must be a number"),
    "notes a string": (lambda d: d.update(notes="hello"), "'notes' must be a list of strings"),
    "matrix of numbers": (lambda d: d["link_matrix"][0].__setitem__(1, 3),
                          "'link_matrix' must be a list of lists of link class names"),
    "unknown key": (lambda d: d.update(colour="red"), "unknown key 'colour'"),
    "no devices key": (lambda d: d.pop("devices"), "missing key 'devices'"),
    "bad nic port": (lambda d: d["nics"][0].update(port="1"), "nics[0].port = '1' must be"),
    "unknown class": (lambda d: d["link_matrix"][0].__setitem__(1, "warp"),
                      "is not a link class"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_files_are_refused_by_dtenjax_and_the_json_schema(name):
  jsonschema = pytest.importorskip("jsonschema")   # in the test extra; absent: a bare install
  mutate, message = BROKEN[name]
  d = json.loads(Topology.fixture("roce_a100_4x8").to_json())
  mutate(d)
  with pytest.raises(errors.TopologyError) as e:
    Topology.from_dict(d, "t.json")
  assert message in str(e.value)
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate(d, _schema())


def test_every_topology_dtenjax_writes_matches_the_json_schema(cpu_devices):
  jsonschema = pytest.importorskip("jsonschema")
  schema = _schema()
  jsonschema.Draft202012Validator.check_schema(schema)
  # The schema's link matrix is a list of lists of class names, nothing about its lengths: each
  # document's matrix is validated as one row of the classes it holds (h100_1024's million cells
  # took 4.4 s of CPU through jsonschema), after checking that it is a list of lists.
  cells = schema["properties"]["link_matrix"]
  assert cells == {"type": "array", "items": {"type": "array", "items": {"enum": cells["items"][
      "items"]["enum"]}}}, "the schema constrains the matrix further: validate it whole again"
  validator = jsonschema.Draft202012Validator(schema)
  written = [Topology.fixture(n) for n in Topology.fixtures()] + [Topology.detect(cpu_devices)]
  for t in written:
    d = json.loads(t.to_json())
    matrix = d["link_matrix"]
    assert isinstance(matrix, list) and all(isinstance(row, list) for row in matrix), t.name
    names = {c for row in matrix for c in row if isinstance(c, str)}   # each once
    others = [c for row in matrix for c in row if not isinstance(c, str)]
    validator.validate({**d, "link_matrix": [sorted(names) + others]})
  assert schema["properties"]["format"] == {"const": topo.FORMAT}
  assert set(schema["properties"]["link_matrix"]["items"]["items"]["enum"]) == set(
      topo.LINK_ORDER)


# --- "unknown" links ---------------------------------------------------------------------------------


def test_unknown_links_are_priced_as_pcie_and_group_by_host():
  from dtenjax._src.pricing import costmodel
  devs = [_dev(i, host=f"h{i // 4}") for i in range(8)]
  unknown = topo.uniform("u", devs, intra="unknown", inter="roce")
  pcie = topo.uniform("p", devs, intra="pcie", inter="roce")
  assert unknown.spec("unknown") == pcie.spec("pcie") == LinkSpec(24.0, 5.0)
  from dtenjax._src.collectives.algorithms import registry
  for record in registry.REGISTRY:
    for group in ([0, 1, 2, 3], list(range(8))):
      assert costmodel.collective_time("all_reduce", 1 << 20, group, unknown, record.cost) == \
          costmodel.collective_time("all_reduce", 1 << 20, group, pcie, record.cost), (
              record.name, group)
  assert unknown.fast_islands() == unknown.hosts() == ((0, 1, 2, 3), (4, 5, 6, 7))
  # Slower than every measured class inside a host, faster than any network.
  order = topo.LINK_ORDER
  assert order.index("numa_cross") < order.index("unknown") < order.index("infiniband")
  mixed = Topology("m", tuple(devs[:4]), tuple(
      tuple("local" if a == b else ("nvlink" if a + b == 1 else "unknown") for b in range(4))
      for a in range(4)))
  assert mixed.fast_islands() == ((0, 1), (2,), (3,))
  assert mixed.slowest_link([0, 1, 2])[0] == "unknown"
