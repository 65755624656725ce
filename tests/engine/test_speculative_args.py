"""Speculative decoding's engine arguments: checked, with clear errors, before anything loads."""

from __future__ import annotations

import pytest

from conveyor.core.spec_decode.ngram import NgramProposer
from conveyor.engine.args import EngineArgs
from conveyor.engine.speculative import build_speculative


def test_engine_speculative_arguments_are_checked():
    with pytest.raises(ValueError, match="speculative_model is the draft model"):
        build_speculative(EngineArgs(speculative_model="x.gguf"), None, 8, 0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        build_speculative(EngineArgs(speculative_method="ngram", num_speculative_tokens=0),
                          None, 8, 0)


    class Executor:
        def use_proposer(self, config, proposer) -> None:
            self.config, self.proposer = config, proposer

    executor = Executor()
    config = build_speculative(EngineArgs(speculative_method="ngram"), executor, 8, 0)
    assert config.disable_by_batch_size == 4 and executor.config is config
    assert isinstance(executor.proposer, NgramProposer)
