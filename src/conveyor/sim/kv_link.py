"""The link that carries a prefilled request's KV blocks from a prefill to a decode instance.

A ``LinkSpec`` is a bandwidth per GPU (one direction) and a fixed latency per transfer. The
presets (``parse_link``):

* ``nvlink``: the hardware spec's ``interconnect_bandwidth_gbs`` / ``interconnect_latency_us``
  (prefill and decode GPUs in one NVLink domain, as DistServe places them; on a spec without
  NVLink, such as ``l4``, that field is its PCIe figure);
* ``pcie``: the spec's ``host_link_bandwidth_gbs`` (GPU to GPU over the PCIe switch), 10 µs;
* ``rdma``: 50 GB/s (one 400 Gb/s NIC per GPU: ConnectX-7 / InfiniBand NDR, as on DGX H100),
  10 µs, for instances on different machines;
* a number: that many GB/s, 10 µs.

With tensor parallelism every GPU sends its own shard of the KV (``CostModel.block_bytes`` is
per GPU) over its own link, at the same time. ``KVLink`` is one decode instance's inbound
link: transfers into that instance queue behind each other (first come, first served).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.sim.specs import GB, HardwareSpec

RDMA_GBS = 50.0  # 400 Gb/s per GPU
DEFAULT_LATENCY_US = 10.0
PRESETS = ("nvlink", "pcie", "rdma")


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth_gbs: float  # per GPU, one direction
    latency_us: float = DEFAULT_LATENCY_US

    def __post_init__(self) -> None:
        if not self.bandwidth_gbs > 0:
            raise ValueError(f"KV link bandwidth must be > 0 GB/s, got {self.bandwidth_gbs!r}")
        if not self.latency_us >= 0:
            raise ValueError(f"KV link latency must be >= 0 us, got {self.latency_us!r}")

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbs * GB)

    def __str__(self) -> str:
        return f"{self.name}: {self.bandwidth_gbs:g} GB/s, {self.latency_us:g} us"


def parse_link(text: str, hardware: HardwareSpec) -> LinkSpec:
    """``nvlink``, ``pcie``, ``rdma`` or a bandwidth in GB/s (see the module docstring)."""
    name = text.strip().lower()
    if name == "nvlink":
        if hardware.interconnect_bandwidth_gbs <= 0:
            raise ValueError(f"hardware {hardware.name} has no GPU interconnect "
                             f"(interconnect_bandwidth_gbs is 0); use --kv-link pcie, rdma or "
                             f"a bandwidth in GB/s")
        return LinkSpec(f"nvlink ({hardware.name} interconnect)", hardware.interconnect_bandwidth_gbs,
                        hardware.interconnect_latency_us)
    if name == "pcie":
        return LinkSpec(f"pcie ({hardware.name} host link)", hardware.host_link_bandwidth_gbs)
    if name == "rdma":
        return LinkSpec("rdma", RDMA_GBS)
    try:
        bandwidth = float(name.removesuffix("gb/s"))
    except ValueError:
        raise ValueError(f"bad --kv-link {text!r}: use {', '.join(PRESETS)} or a bandwidth in "
                         f"GB/s (e.g. 25)") from None
    return LinkSpec(f"{bandwidth:g} GB/s", bandwidth)


class KVLink:
    """One decode instance's inbound link: transfers queue first come, first served."""

    def __init__(self, spec: LinkSpec, block_bytes: float) -> None:
        self.spec = spec
        self.block_bytes = block_bytes
        self.free_at = 0.0  # when the transfer in progress (if any) ends
        self.num_transfers = 0
        self.num_blocks = 0
        self.busy_s = 0.0

    def transfer(self, now: float, num_blocks: int) -> float:
        """Queue ``num_blocks`` blocks at ``now``; returns when they have all arrived."""
        duration = self.spec.transfer_s(num_blocks * self.block_bytes)
        done = max(now, self.free_at) + duration
        self.free_at = done
        self.num_transfers += 1
        self.num_blocks += num_blocks
        self.busy_s += duration
        return done
