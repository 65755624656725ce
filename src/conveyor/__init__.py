"""Conveyor: a continuous-batching LLM inference engine."""

from conveyor.core.sampling_params import RequestOutputKind, SamplingParams
from conveyor.core.structured_outputs_params import StructuredOutputsParams

__all__ = ["SamplingParams", "RequestOutputKind", "StructuredOutputsParams", "LLM"]
__version__ = "0.1.0"


def __getattr__(name: str):  # LLM pulls in torch: import it only when asked for
    if name == "LLM":
        from conveyor.engine.llm import LLM

        return LLM
    raise AttributeError(name)
