"""The scheduler's speculative-decoding arguments (config and proposer) from EngineArgs."""

from __future__ import annotations

from typing import Any

from conveyor.core.spec_decode.config import SpeculativeConfig
from conveyor.core.spec_decode.ngram import NgramProposer
from conveyor.engine.args import EngineArgs


def speculative_from_args(args: EngineArgs) -> dict[str, Any]:
    """``speculative`` and ``proposer`` keywords for ``Scheduler`` (empty when off)."""
    if args.speculative_method is None:
        return {}
    config = SpeculativeConfig(method=args.speculative_method,
                               num_speculative_tokens=args.num_speculative_tokens,
                               prompt_lookup_min=args.ngram_prompt_lookup_min,
                               prompt_lookup_max=args.ngram_prompt_lookup_max,
                               disable_by_batch_size=args.speculative_disable_by_batch_size)
    return {"speculative": config,
            "proposer": NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)}
