"""The links collectives run over: the GPU-to-GPU link inside a node, the network between nodes, and the GPUs'
dense bf16 peaks, for `make plan --comms`. Figures are vendors' nominal rates, per GPU and per direction, in GB/s
(1e9 bytes/s); a real collective reaches less (nccl-tests' busBw measures what a system really gets), so every time
computed from them is a lower bound.

Inside a node (NVIDIA datasheets; NVLink figures are quoted bidirectional, so halved here):
- H100 / H200 SXM: NVLink 4, 900 GB/s bidirectional -> 450 per direction; HGX boards join 8 GPUs through NVSwitch.
- B200: NVLink 5, 1.8 TB/s -> 900; 8 per HGX board.
- A100 SXM (80 and 40 GB): NVLink 3, 600 GB/s -> 300; 8 per HGX board.
- V100 SXM2: NVLink 2, 300 GB/s -> 150; 8 per DGX-1 (a hybrid cube mesh, not all-to-all: optimistic).
- H100 NVL: NVLink bridge between pairs, 600 GB/s -> 300; a pair is the NVLink domain, the rest is PCIe Gen5.
- PCIe cards (H100 PCIe, L40S, A10G, L4, T4): no NVLink counted; PCIe Gen5 x16 is 64 GB/s per direction, Gen4 32,
  Gen3 16 (PCI-SIG), an upper bound for GPU-to-GPU traffic through a switch or the CPU.
GH200 is left out: its GPU-to-GPU links depend on the system around the superchip.

Between nodes (`--network`, or `--network-gbps` for any other figure): one NIC per GPU, the DGX H100 / DGX A100
layout (8 x ConnectX-7 400 Gb/s NDR, 8 x ConnectX-6 200 Gb/s HDR). The default is NDR InfiniBand, 400 Gb/s =
50 GB/s per GPU per direction. A node with fewer NICs than GPUs shares them: pass its per-GPU share.
"""

from __future__ import annotations

import dataclasses

from fsdp_recipes.errors import UserError
from fsdp_recipes.metrics import flops

PCIE = {"gen5": 64.0, "gen4": 32.0, "gen3": 16.0}


@dataclasses.dataclass(frozen=True)
class NodeFabric:
    link: str  # what carries traffic between GPUs in the NVLink domain
    gbps: float  # GB/s per GPU per direction on that link
    domain: int  # GPUs joined by it (1: none)
    pcie: float  # GB/s per GPU per direction over PCIe, for groups larger than the domain


NODE_FABRIC = {
    "H100": NodeFabric("NVLink 4", 450.0, 8, PCIE["gen5"]),
    "H200": NodeFabric("NVLink 4", 450.0, 8, PCIE["gen5"]),
    "B200": NodeFabric("NVLink 5", 900.0, 8, PCIE["gen5"]),
    "A100": NodeFabric("NVLink 3", 300.0, 8, PCIE["gen4"]),
    "A100-40GB": NodeFabric("NVLink 3", 300.0, 8, PCIE["gen4"]),
    "V100": NodeFabric("NVLink 2", 150.0, 8, PCIE["gen3"]),
    "H100-NVL": NodeFabric("NVLink bridge", 300.0, 2, PCIE["gen5"]),
    "H100-PCIE": NodeFabric("PCIe Gen5", PCIE["gen5"], 1, PCIE["gen5"]),
    "L40S": NodeFabric("PCIe Gen4", PCIE["gen4"], 1, PCIE["gen4"]),
    "A10G": NodeFabric("PCIe Gen4", PCIE["gen4"], 1, PCIE["gen4"]),
    "L4": NodeFabric("PCIe Gen4", PCIE["gen4"], 1, PCIE["gen4"]),
    "T4": NodeFabric("PCIe Gen3", PCIE["gen3"], 1, PCIE["gen3"]),
}

# name -> (description, Gb/s per GPU); GB/s is Gb/s / 8
NETWORKS = {
    "ndr": ("InfiniBand NDR, one 400 Gb/s NIC per GPU", 400.0),
    "hdr": ("InfiniBand HDR, one 200 Gb/s NIC per GPU", 200.0),
    "xdr": ("InfiniBand XDR, one 800 Gb/s NIC per GPU", 800.0),
    "roce-400": ("RoCE, one 400 GbE NIC per GPU", 400.0),
    "roce-200": ("RoCE, one 200 GbE NIC per GPU", 200.0),
}
DEFAULT_NETWORK = "ndr"

# the planner's GPU names -> the names flops.PEAK_BF16_DENSE_FLOPS matches (torch.cuda.get_device_name's spelling)
PEAK_NAMES = {"H100-PCIE": "H100 PCIe", "H100-NVL": "H100 NVL", "A100-40GB": "A100", "A10G": "A10"}


@dataclasses.dataclass(frozen=True)
class Fabric:
    gpu: str
    node: NodeFabric | None
    network: str  # description
    network_gbps: float  # GB/s per GPU per direction
    peak_flops: float | None  # dense bf16 FLOP/s


def fabric(gpu: str, network: str | None = None, network_gbit: float | None = None) -> Fabric:
    """The links of `gpu` (a planner GPU name, already checked) and the inter-node network; one line for an
    unknown network name."""
    if network_gbit is not None:
        if network_gbit <= 0:
            raise UserError(f"--network-gbps {network_gbit}: it must be positive. Fix: the Gb/s each GPU has "
                            "between nodes, e.g. 400.")
        desc, gbit = f"{network_gbit:g} Gb/s per GPU (given)", network_gbit
    else:
        name = (network or DEFAULT_NETWORK).lower()
        if name not in NETWORKS:
            raise UserError(f"unknown network '{network}'. Fix: --network <one of {', '.join(NETWORKS)}>, or "
                            "--network-gbps <Gb/s per GPU>.")
        desc, gbit = NETWORKS[name]
        desc = f"{name}: {desc}"
    peak, _ = flops.peak_flops(PEAK_NAMES.get(gpu, gpu))
    return Fabric(gpu, NODE_FABRIC.get(gpu), desc, gbit / 8, peak)
