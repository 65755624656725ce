"""KVOffloadConfig: the tiers of the offloading KV connector, validated on construction.

Every invalid value raises ``ValueError`` naming the option as the command line spells it.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_bytes(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer number of bytes >= 0, got {value!r}")


@dataclass(frozen=True)
class KVOffloadConfig:
    """``cpu_bytes`` of host memory, then ``disk_bytes`` of files under ``disk_path``, hold the
    blocks the pool evicts (least recently used leave each tier first)."""

    cpu_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        _check_bytes("--kv-offload-cpu-bytes", self.cpu_bytes)
        _check_bytes("--kv-offload-disk-bytes", self.disk_bytes)
        if self.disk_path is not None and not isinstance(self.disk_path, str):
            raise ValueError(f"--kv-offload-disk must be a directory path, got {self.disk_path!r}")
        if self.disk_path == "":
            raise ValueError("--kv-offload-disk must be a directory path, got ''")
        if self.disk_path is None and self.disk_bytes:
            raise ValueError("--kv-offload-disk-bytes needs --kv-offload-disk PATH (the "
                             "directory that holds the disk tier)")
        if self.disk_path is not None and not self.disk_bytes:
            raise ValueError(f"--kv-offload-disk {self.disk_path} needs --kv-offload-disk-bytes "
                             "N > 0 (the most bytes its files may take)")

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_bytes or self.disk_bytes)
