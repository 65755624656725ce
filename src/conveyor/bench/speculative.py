"""``conveyor bench throughput --speculative ngram,off``: one Conveyor row per speculative
method, and the acceptance figures each row reports."""

from __future__ import annotations

import dataclasses

from conveyor.core.stats import SchedulerStats
from conveyor.engine.args import EngineArgs

OFF = "off"


def speculative_methods(text: str) -> list[str]:
    """The methods of ``--speculative`` (``off``: none); ValueError on an unknown one."""
    from conveyor.core.spec_decode.config import METHODS

    methods = [m.strip() for m in (text or "").split(",") if m.strip()]
    for m in methods:
        if m != OFF and m not in METHODS:
            raise ValueError(f"--speculative: unknown method {m!r}; known: "
                             f"{', '.join((*METHODS, OFF))}")
    return methods


def speculative_variants(engine_args: EngineArgs, text: str) -> list[tuple[EngineArgs, str, str]]:
    """(engine args, progress note, row note) per method; empty without ``--speculative``."""
    variants = []
    for m in speculative_methods(text):
        args = dataclasses.replace(engine_args, speculative_method=None if m == OFF else m)
        what = f"speculative {m}" if m == OFF else \
            f"speculative {m}, k={engine_args.num_speculative_tokens}"
        variants.append((args, what, f" ({what})"))
    return variants


def acceptance_line(stats: SchedulerStats) -> str | None:
    """Proposed / accepted tokens and the mean accepted length, from a row's scheduler stats."""
    if not stats.spec_draft_tokens:
        return None
    return (f"speculative tokens accepted {stats.spec_accepted_tokens:,} of "
            f"{stats.spec_draft_tokens:,} ({stats.spec_acceptance_rate:.1%}), "
            f"{stats.spec_mean_accepted_length:.2f} tokens per verifying decode")
