"""LoRAPool: where each adapter an engine serves lives, and moving it between the tiers.

Three tiers, as S-LoRA and vLLM keep them:

* **known**: every adapter the engine serves (checked once when added), by int id;
* **host**: at most ``max_cpu_loras`` adapters' weights read into host memory, least recently
  used first out; one that left is read again from its files when a request needs it, on a
  background thread, so the running batch never waits for the disk;
* **slots**: the ``max_loras`` adapters the model computes with (``model/layers/lora.py``),
  least recently used first out, installed from the host tier between two steps.

The scheduler lets a request start only once its adapter is in the host tier
(``Scheduler.loaded_loras``); the engine pins the adapters of running requests there
(``pinned``) and asks for the next ones the queue needs (``prefetch``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from conveyor.lora.adapter import LoRAAdapter
from conveyor.lora.request import LoRARequest

Install = Callable[[int, LoRAAdapter], None]  # put an adapter in a slot of the model


class LoRAPool:
    def __init__(self, max_slots: int, max_host: int,
                 read: Callable[[LoRARequest], LoRAAdapter], install: Install) -> None:
        if max_slots < 1 or max_host < max_slots:
            raise ValueError(f"max_cpu_loras ({max_host}) must be at least max_loras "
                             f"({max_slots}), which must be >= 1")
        self.max_slots, self.max_host = max_slots, max_host
        self._read, self._install = read, install
        self.known: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recent first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter -> slot, least recent first
        self.loading: dict[int, Future[LoRAAdapter]] = {}
        self._reader: ThreadPoolExecutor | None = None
        self.num_reads = 0  # reads from files after the first (the host tier was full)
        self.num_installs = 0  # adapters installed into a slot

    # ------------------------------------------------------------------ adapters

    def add(self, request: LoRARequest, adapter: LoRAAdapter, pinned: set[int]) -> None:
        """Serve ``request``'s adapter (``adapter``: its files, already read and checked)."""
        self.known[request.lora_int_id] = request
        self._drop_slot(request.lora_int_id)  # a re-added id may hold other weights
        if self._make_room(1, pinned):
            self.host[request.lora_int_id] = adapter

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (no request of it is left)."""
        self.known.pop(lora_id, None)
        self.host.pop(lora_id, None)
        self._drop_slot(lora_id)
        future = self.loading.pop(lora_id, None)
        if future is not None:
            future.cancel()

    def _drop_slot(self, lora_id: int) -> None:
        # The slot's weights stay until another adapter is installed over them; nothing
        # computes with them meanwhile (no request of this id runs).
        self.slot_of.pop(lora_id, None)

    # ------------------------------------------------------------------ host tier

    def _make_room(self, n: int, pinned: set[int]) -> bool:
        """Evict unpinned adapters (least recent first) until ``n`` more fit; False if they
        cannot."""
        while len(self.host) + len(self.loading) + n > self.max_host:
            victim = next((i for i in self.host if i not in pinned), None)
            if victim is None:
                return False
            del self.host[victim]
        return True

    def prefetch(self, wanted: Iterable[int], pinned: set[int]) -> None:
        """Start reading the adapters of ``wanted`` (in the order the queue needs them) that
        are not in the host tier, as far as room allows."""
        for lora_id in wanted:
            if lora_id in self.host:
                self.host.move_to_end(lora_id)
                pinned = pinned | {lora_id}  # keep what the queue needs next
                continue
            if lora_id in self.loading or lora_id not in self.known:
                continue
            if not self._make_room(1, pinned):
                return
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="conveyor-lora")
            self.loading[lora_id] = self._reader.submit(self._read, self.known[lora_id])
            pinned = pinned | {lora_id}

    def poll(self, timeout: float = 0.0) -> dict[int, Exception]:
        """Move finished reads into the host tier (waiting up to ``timeout`` for one); the
        adapters whose read failed (their files changed on disk), with the error: the engine
        stops serving those."""
        failed: dict[int, Exception] = {}
        if not self.loading:
            return failed
        if timeout > 0:
            wait(list(self.loading.values()), timeout, return_when="FIRST_COMPLETED")
        for lora_id, future in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[lora_id]
            try:
                self.host[lora_id] = future.result()
            except Exception as e:  # noqa: BLE001 - reported to the engine with the adapter
                failed[lora_id] = e
                continue
            self.num_reads += 1
        return failed

    # ------------------------------------------------------------------ slots

    def place(self, lora_ids: set[int]) -> None:
        """Install each of a step's adapters in a slot (all in the host tier: the scheduler
        started only those), evicting the least recently used adapters not in the step."""
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            used = set(self.slot_of.values())
            free = next((s for s in range(1, self.max_slots + 1) if s not in used), None)
            if free is None:
                victim = next(i for i in self.slot_of if i not in lora_ids)
                free = self.slot_of.pop(victim)
            self._install(free, self.host[lora_id])
            self.host.move_to_end(lora_id)
            self.slot_of[lora_id] = free
            self.num_installs += 1

    def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
            self._reader = None
