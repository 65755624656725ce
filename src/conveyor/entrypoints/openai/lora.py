"""LoRA adapters on the server: ``--lora-modules name=path`` at start, vLLM's
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` at run time, only with
``--allow-runtime-lora`` (a 403 otherwise) and, with ``--lora-root``, only from under those
directories (``server_paths``: no answer tells a client what exists elsewhere on the disk). A
request picks an adapter by naming it as its ``model``; ``/v1/models`` lists the adapters beside
the base model. Loading reads the files on a worker thread; unloading lets the adapter's running
requests finish under it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from conveyor.entrypoints.openai.errors import APIError, bad_request
from conveyor.entrypoints.openai.limits import ServerLimits
from conveyor.entrypoints.openai.request_model import RequestModel
from conveyor.entrypoints.openai.serving import parse_body

if TYPE_CHECKING:
    from conveyor.entrypoints.openai.state import ServerState


class LoadLoRARequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; the name is what counts


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``--lora-modules name=path ...`` -> {name: path}; ValueError naming a bad item."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path items, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def _check_runtime_loading(state: ServerState) -> None:
    if not state.allow_runtime_lora:
        raise APIError(403, "Loading and unloading LoRA adapters at run time is off on this "
                       "server (start it with --allow-runtime-lora; adapters of --lora-modules "
                       "are served from the start).", code="runtime_lora_disabled")


async def load_lora_adapter(state: ServerState, request: Request,
                            limits: ServerLimits) -> Response:
    _check_runtime_loading(state)
    req = parse_body(await request.body(), LoadLoRARequest, limits)
    try:
        state.check_lora_name(req.lora_name)
    except ValueError as e:
        raise bad_request(str(e), param="lora_name") from e
    path = state.lora_paths.resolve(req.lora_path, "lora_path", "--lora-root")
    try:
        await state.add_lora(req.lora_name, path)
    except APIError:
        raise
    except Exception as e:  # a bad adapter, or one the server cannot read
        raise state.lora_paths.failure(path, str(e), "lora_path", "--lora-root") from e
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(state: ServerState, request: Request,
                              limits: ServerLimits) -> Response:
    _check_runtime_loading(state)
    req = parse_body(await request.body(), UnloadLoRARequest, limits)
    engine = state.ready_engine()
    lora = state.loras.pop(req.lora_name, None)
    if lora is None:
        raise APIError(404, f"The LoRA adapter '{req.lora_name}' is not served.",
                       param="lora_name", code="model_not_found")
    await engine.remove_lora(lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
