"""The OpenAI server's structured outputs: ``response_format`` (``json_object``, ``json_schema``)
and vLLM's ``structured_outputs`` extra field become a StructuredOutputsParams; before a request
reaches the engine its constraint is compiled (through the engine's compile cache, in its worker
processes), so a schema, regex or grammar the compiler rejects, or one that takes longer than
``--structured-outputs-compile-timeout``, is a 400 with the reason.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from conveyor.core.structured_outputs_params import StructuredOutputsParams
from conveyor.entrypoints.openai.disconnect import until_disconnect
from conveyor.entrypoints.openai.errors import bad_request

if TYPE_CHECKING:
    from starlette.requests import Request

    from conveyor.core.sampling_params import SamplingParams
    from conveyor.engine.async_engine import AsyncEngine


def structured_outputs_params(req: Any) -> StructuredOutputsParams | None:
    """The request's constraint from ``response_format`` or ``structured_outputs`` (ValueError
    when both are set or one is malformed)."""
    fmt, extra = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise ValueError("response_format and structured_outputs cannot both constrain a request")
    if extra is not None:
        fields = extra.model_dump(by_alias=True, exclude_none=True)
        return StructuredOutputsParams(**fields)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ValueError("response_format.json_schema.schema is required when "
                         "response_format.type is 'json_schema'")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


async def compile_constraint(engine: AsyncEngine, params: SamplingParams, param: str,
                             request: Request) -> None:
    """Compile ``params``' constraint now (cached for the engine); a 400 naming ``param`` when
    it cannot be, or not within the time limit. A client that leaves first ends the wait (499),
    and the compile stops unless another request waits for the same constraint."""
    constraint = params.structured_outputs
    if constraint is None:
        return
    cache = await asyncio.to_thread(engine.structured_outputs_compile_cache)
    future = cache.submit(constraint)
    try:
        # shielded: cancelling this wait must not cancel a compile other requests share
        await until_disconnect(request, asyncio.shield(asyncio.wrap_future(future)))
    except ValueError as e:
        raise bad_request(str(e), param=param) from e
    finally:
        cache.release(future)


def constraint_param(req: Any) -> str:
    """The request field a constraint came from, for error bodies."""
    if getattr(req, "structured_outputs", None) is not None:
        return "structured_outputs"
    if getattr(req, "tool_choice", None) not in (None, "none", "auto"):
        return "tool_choice"
    return "response_format"
