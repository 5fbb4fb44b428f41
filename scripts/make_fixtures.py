"""Regenerates dtenjax/fixtures/*.json, the shipped reference topologies.

Run: .venv/bin/python scripts/make_fixtures.py
"""

import pathlib

from dtenjax._src.topology.model import DeviceInfo, NicInfo, NumaNode, uniform

OUT = pathlib.Path(__file__).resolve().parent.parent / "dtenjax" / "fixtures"
GB = 1 << 30


def gpus(kind, mem_gb, hosts, per_host, numa_split=True):
  devs = []
  for h in range(hosts):
    for i in range(per_host):
      devs.append(DeviceInfo(id=h * per_host + i, platform="gpu", kind=kind,
                             memory_bytes=mem_gb * GB, process_index=h * per_host + i,
                             host=f"node{h}", numa_node=(i * 2 // per_host) if numa_split else 0,
                             local_index=i))
  return devs


def numa(hosts, per_host_nodes=2):
  return [NumaNode(host=f"node{h}", id=n, cpus=f"{n * 64}-{n * 64 + 63}")
          for h in range(hosts) for n in range(per_host_nodes)]


def main():
  OUT.mkdir(exist_ok=True)
  topos = [
      uniform("dgx_a100_8", gpus("NVIDIA A100-SXM4-80GB", 80, 1, 8), intra="nvlink",
              numa_nodes=numa(1),
              notes=["seed reference: one node, 8 x A100 fully NVLink-connected "
                     "(NVLink3, 12 links x 25 GB/s = 300 GB/s per direction)"]),
      uniform("roce_a100_4x8", gpus("NVIDIA A100-SXM4-80GB", 80, 4, 8), intra="nvlink",
              inter="roce", numa_nodes=numa(4),
              nics=[NicInfo(name=f"mlx5_{n}", host=f"node{h}", port=1, link_layer="Ethernet",
                            state="ACTIVE", bandwidth_gbps=12.5, numa_node=n // 2)
                    for h in range(4) for n in range(4)],
              notes=["seed reference: 4 nodes x 8 x A100 over RoCE v2, 100 Gb/s NICs, RTT ~5 us"]),
      uniform("h200_8", gpus("NVIDIA H200", 141, 1, 8), intra="nvswitch", numa_nodes=numa(1),
              notes=["8 x H200 SXM through NVSwitch (NVLink4, 450 GB/s per direction)"]),
      uniform("pcie_8", gpus("NVIDIA L40S", 48, 1, 8), intra="pcie", numa_nodes=numa(1),
              notes=["8 GPUs on PCIe 4.0 only, two sockets: cross-socket pairs use numa_cross"]),
  ]
  for t in topos:
    (OUT / f"{t.name}.json").write_text(t.to_json() + "\n", encoding="utf-8")
    print("wrote", OUT / f"{t.name}.json")


if __name__ == "__main__":
  main()
