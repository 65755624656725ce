"""The engine's KV connector and KV events, set up from EngineArgs.

``setup_kv_connector`` checks the options (``KVOffloadConfig``) and the engine they would run in,
refusing with a clear error what is not supported: tensor parallelism, a device other than the
CPU, hybrid KV caches (several KV-cache groups), a draft model (its own KV cache would not
follow the loads), prefix caching off. It derives the *key namespace* (the model's weights,
dtypes and block layout: ``ModelExecutor.kv_identity``), in which content keys name blocks, so a
disk tier shared by engines of other models or layouts never mixes their blocks; sizes the tiers
in blocks (a block's bytes plus its stored header); prepares the disk tier's directory
(``<--kv-offload-disk>/<namespace>``); and starts both halves: the scheduler's
(``TieredOffloadScheduler``, handed the blocks the directory holds already) and the executor's.

With ``kv_transfer`` (prefill/decode disaggregation) blocks are keyed in the same namespace: a
producer only needs the namespace (``engine/kv_transfer.py`` reads its blocks out); a consumer
gets an ``InboundKVScheduler`` and the executor's runner half over an ``InboundStore``. The
tiers and the transfer do not combine yet (one connector per engine).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from conveyor.core.kv_connector.config import KVOffloadConfig
from conveyor.core.kv_connector.events import DISK, KVEventLog
from conveyor.core.kv_connector.inbound import InboundKVScheduler
from conveyor.core.kv_connector.keys import KEY_BYTES, root_key
from conveyor.core.kv_connector.offload import TieredOffloadScheduler
from conveyor.engine.args import EngineArgs
from conveyor.engine.kv_transfer import KV_TRANSFER_ROLES
from conveyor.executor.base import EngineExecutor
from conveyor.executor.kv_block_file import header_size

logger = logging.getLogger("conveyor.engine")


@dataclass
class KVConnectorSetup:
    connector: TieredOffloadScheduler | InboundKVScheduler | None = None
    events: KVEventLog | None = None
    namespace: bytes | None = None  # None: blocks are not keyed (none of these)
    inbound: Any = None  # a consumer's InboundStore (the bytes handed over)


def offload_config(args: EngineArgs) -> KVOffloadConfig:
    return KVOffloadConfig(args.kv_offload_cpu_bytes, args.kv_offload_disk,
                           args.kv_offload_disk_bytes)


def setup_kv_connector(args: EngineArgs, executor: EngineExecutor) -> KVConnectorSetup:
    """Both halves of the offloading connector and the KV event log the args ask for (after
    ``executor.initialize_cache``)."""
    config = offload_config(args)
    if not isinstance(args.kv_events, bool):
        raise ValueError(f"kv_events must be a bool, got {args.kv_events!r}")
    if args.kv_transfer is not None and args.kv_transfer not in KV_TRANSFER_ROLES:
        raise ValueError(f"kv_transfer must be None, 'producer' or 'consumer', got "
                         f"{args.kv_transfer!r}")
    if not config.enabled and not args.kv_events and args.kv_transfer is None:
        return KVConnectorSetup()
    if config.enabled and args.kv_transfer is not None:
        raise ValueError("KV offload (--kv-offload-*) and prefill/decode disaggregation "
                         "(--kv-transfer, --pd) do not combine yet: an engine has one KV "
                         "connector")
    if config.enabled or args.kv_transfer is not None:
        _check_supported(args, executor, "--kv-offload-*" if config.enabled else "--pd")
    block_size = args.block_size
    namespace = blake2b(executor.kv_identity(block_size).encode(),
                        digest_size=KEY_BYTES).digest()
    events = KVEventLog(block_size) if args.kv_events else None
    if args.kv_transfer == "consumer":
        store = executor.start_kv_inbound(namespace, block_size)
        return KVConnectorSetup(InboundKVScheduler(block_size), events, namespace, store)
    if not config.enabled:
        return KVConnectorSetup(None, events, namespace)
    stored = executor.kv_cache_bytes_per_block(block_size) + header_size(block_size)
    cpu_blocks = _tier_blocks("--kv-offload-cpu-bytes", config.cpu_bytes, stored, block_size)
    disk_blocks = _tier_blocks("--kv-offload-disk-bytes", config.disk_bytes, stored, block_size)
    disk_dir = _disk_dir(config.disk_path, namespace) if config.disk_path else None
    connector = TieredOffloadScheduler(cpu_blocks, disk_blocks, block_size,
                                       root_key(namespace, 0), events)
    found = executor.start_kv_offload(namespace, block_size, disk_dir)
    if found:
        connector.adopt(DISK, found)
    logger.info("KV offload: %d blocks of %d bytes in host memory, %d on disk%s (%d found there)",
                cpu_blocks, stored, disk_blocks, f" in {disk_dir}" if disk_dir else "",
                len(found))
    return KVConnectorSetup(connector, events, namespace)


def _check_supported(args: EngineArgs, executor: EngineExecutor, flag: str) -> None:
    what = ("KV offload (--kv-offload-*)" if flag == "--kv-offload-*"
            else "prefill/decode disaggregation (--pd)")
    if not args.enable_prefix_caching:
        raise ValueError(f"{what} extends the prefix cache: it needs --enable-prefix-caching")
    if args.tensor_parallel_size > 1:
        raise ValueError(f"{what} does not support tensor parallelism yet "
                         "(--tensor-parallel-size > 1): each rank's share of a block would have "
                         "to move with it")
    if executor.device.type != "cpu":
        raise ValueError(f"{what} runs on the CPU device only for now; "
                         f"this engine runs on {str(executor.device)!r}")
    groups = executor.kv_cache_groups
    if len(groups) > 1:
        raise ValueError(f"{what} does not support hybrid KV caches yet: "
                         f"this model's layers form {len(groups)} KV-cache groups "
                         "(sliding-window and global attention)")
    if args.speculative_method == "draft_model":
        raise ValueError(f"{what} does not support --speculative-method "
                         "draft_model: the draft model's KV cache would not follow the loads")


def _tier_blocks(flag: str, num_bytes: int, stored: int, block_size: int) -> int:
    blocks = num_bytes // stored
    if num_bytes and not blocks:
        raise ValueError(f"{flag} {num_bytes} holds no KV block: a stored block of "
                         f"{block_size} tokens takes {stored} bytes; give at least {stored} "
                         "(or 0 for no such tier)")
    return blocks


def _disk_dir(path: str, namespace: bytes) -> str:
    """The namespace's directory under ``path``, created if needed; ValueError when it cannot
    be used."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--kv-offload-disk {path}: not a directory")
    directory = os.path.join(path, namespace.hex())
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--kv-offload-disk {path}: cannot create {directory}: "
                         f"{e.strerror or e}") from None
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise ValueError(f"--kv-offload-disk {path}: {directory} is not readable and writable")
    return directory
