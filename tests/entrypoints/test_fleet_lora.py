"""FleetEngine's LoRA adapters over stand-in replicas (no Ray fleet): an adapter loads on every
live replica or on none, unloads from all, and reaches replicas that join later."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conveyor.entrypoints.openai.errors import APIError
from conveyor.lora.request import LoRARequest

pytest.importorskip("ray")

from ray.exceptions import RayTaskError  # noqa: E402

from conveyor.entrypoints.ray_serve.fleet import FleetEngine  # noqa: E402
from conveyor.entrypoints.ray_serve.stats import RouterStats  # noqa: E402

SQL = LoRARequest("sql", 1, "/adapters/sql")


class FakeReplica:
    """A replica's adapter calls; ``fail`` makes its next add_lora raise that exception, as a
    Ray call raises what the replica raised (wrapped in RayTaskError)."""

    def __init__(self) -> None:
        self.loras: dict[int, LoRARequest] = {}
        self.fail: BaseException | None = None
        self.calls: list[str] = []

    async def add_lora(self, lora: LoRARequest) -> None:
        self.calls.append("add")
        if self.fail is not None:
            e, self.fail = self.fail, None
            if isinstance(e, ValueError):
                raise RayTaskError("add_lora", "Traceback ...", e).as_instanceof_cause()
            raise e
        self.loras[lora.lora_int_id] = lora

    async def remove_lora(self, lora_int_id: int) -> bool:
        self.calls.append("remove")
        return self.loras.pop(lora_int_id, None) is not None


class FakeHandle:
    """``handle.<method>.remote(*args, replica=r)``, the calls FleetEngine makes by name."""

    def __init__(self, replicas: dict[str, FakeReplica]) -> None:
        self.replicas = replicas

    def __getattr__(self, method: str) -> Any:
        handle = self

        class _Method:
            @staticmethod
            def remote(*args: Any, replica: str) -> Any:
                return getattr(handle.replicas[replica], method)(*args)

        return _Method


def _fleet(names: list[str]) -> tuple[FleetEngine, dict[str, FakeReplica]]:
    replicas = {n: FakeReplica() for n in names}
    stats = RouterStats(replicas=list(names))
    info = {"tokenizer": None, "model_config": None, "max_model_len": 64, "num_total_blocks": 8}
    return FleetEngine(FakeHandle(replicas), info, stats), replicas


def test_an_adapter_loads_on_every_replica_and_unloads_from_all() -> None:
    async def run() -> None:
        engine, replicas = _fleet(["a", "b", "c"])
        await engine.add_lora(SQL)
        assert all(r.loras == {1: SQL} for r in replicas.values())
        assert engine.loras == {1: SQL}
        assert await engine.remove_lora(1)
        assert all(not r.loras for r in replicas.values()) and not engine.loras
        assert not await engine.remove_lora(1)

    asyncio.run(run())


@pytest.mark.parametrize("failure", [ValueError("adapter_config.json is missing"),
                                     RuntimeError("replica unreachable")])
def test_one_refusal_leaves_no_replica_holding_the_adapter(failure: BaseException) -> None:
    async def run() -> None:
        engine, replicas = _fleet(["a", "b", "c"])
        replicas["b"].fail = failure
        if isinstance(failure, ValueError):  # a 400 with the replica's own message
            with pytest.raises(ValueError) as info:
                await engine.add_lora(SQL)
            assert str(info.value) == str(failure)
        else:
            with pytest.raises(APIError) as api:
                await engine.add_lora(SQL)
            assert api.value.status == 503 and "no replica serves it" in api.value.message
        assert all(not r.loras for r in replicas.values())
        assert replicas["a"].calls == ["add", "remove"]  # it took the adapter, then gave it up
        assert not engine.loras
        await engine.add_lora(SQL)  # the next try succeeds everywhere
        assert all(r.loras == {1: SQL} for r in replicas.values())

    asyncio.run(run())


def test_a_replica_that_joins_gets_the_fleets_adapters() -> None:
    async def run() -> None:
        engine, replicas = _fleet(["a", "b"])
        chat = LoRARequest("chat", 2, "/adapters/chat")
        await engine.add_lora(SQL)
        await engine.add_lora(chat)
        await engine.remove_lora(1)
        replicas["c"] = FakeReplica()  # "b" died, Serve started "c"
        engine.router_stats.replicas = ["a", "c"]
        await engine.sync_loras()
        assert replicas["c"].loras == {2: chat}
        assert replicas["a"].calls.count("add") == 2  # it had them already
        await engine.sync_loras()
        assert replicas["c"].calls == ["add"]  # once
        assert set(engine._installed) == {"a", "c"}

    asyncio.run(run())


def test_no_live_replica_refuses_a_load() -> None:
    async def run() -> None:
        engine, _ = _fleet([])
        with pytest.raises(APIError) as api:
            await engine.add_lora(SQL)
        assert api.value.status == 503 and not engine.loras

    asyncio.run(run())
