"""AsyncEngine on its own (in process): deltas that add up to LLM.generate's outputs, aborts that
free the blocks, rejected requests, and a stop that admits nothing more."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from conveyor.core.sampling_params import RequestOutputKind, SamplingParams
from conveyor.engine.async_engine import ADMIT_PER_TURN, AsyncEngine, EngineStoppedError

pytestmark = pytest.mark.timeout(300)

PROMPT = "The three primary colours are"


async def _collect(engine: AsyncEngine, request_id: str, params: SamplingParams) -> dict:
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    deltas = 0
    async with aclosing(engine.generate(PROMPT, params, request_id)) as gen:
        async for out in gen:
            deltas += 1
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens.setdefault(c.index, []).extend(c.token_ids)
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
    return {"texts": texts, "tokens": tokens, "finish": finish, "deltas": deltas}


def test_async_engine_deltas_abort_and_stop(llm, one_thread) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    sampled = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
    with one_thread():
        want_greedy = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
        want_sampled = llm.generate(PROMPT, sampled, use_tqdm=False)[0]
    engine = llm.llm_engine
    aborted_before = engine.get_stats().finished_by_reason.get("abort", 0)

    async def run() -> tuple:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            # Its streams are deltas whatever output_kind the caller's params ask for.
            delta = greedy.with_output_kind(RequestOutputKind.DELTA)
            got_greedy, got_sampled = await asyncio.gather(
                _collect(ae, "g", delta), _collect(ae, "s", sampled))
            # Leave a long request after two deltas: it is aborted and its blocks come back.
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            async with aclosing(ae.generate(PROMPT, long, "leaver")) as gen:
                seen = [await anext(gen), await anext(gen)]
            for _ in range(400):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(ValueError, match="prompt"):
                async for _ in ae.generate("", greedy, "empty"):
                    pass
            return got_greedy, got_sampled, seen, engine.get_stats()
        finally:
            await asyncio.to_thread(ae.stop)
            with pytest.raises(EngineStoppedError):
                async for _ in ae.generate(PROMPT, greedy, "late"):
                    pass

    with one_thread():
        got_greedy, got_sampled, seen, stats = asyncio.run(run())
    want = want_greedy.outputs[0]
    assert got_greedy["texts"] == {0: want.text}
    assert got_greedy["tokens"] == {0: want.token_ids}
    assert got_greedy["finish"] == {0: want.finish_reason}
    assert got_greedy["deltas"] == len(want.token_ids)  # one delta per decode step
    assert got_sampled["tokens"] == {c.index: c.token_ids for c in want_sampled.outputs}
    assert got_sampled["texts"] == {c.index: c.text for c in want_sampled.outputs}
    assert all(len(o.outputs[0].token_ids) == 1 for o in seen)  # deltas, not cumulative
    assert stats.finished_by_reason.get("abort", 0) == aborted_before + 1
    assert stats.scheduler.num_running == 0 and stats.scheduler.num_waiting == 0 and stats.scheduler.kv_usage == 0.0


def test_a_flood_is_admitted_a_turn_at_a_time_and_its_aborts_never_run(llm, one_thread) -> None:
    """2.5 turns' worth of requests at once: the engine holds at most ``ADMIT_PER_TURN`` more
    after a step than after the one before, and requests aborted before their turn came never reach it."""
    engine = llm.llm_engine
    total = 2 * ADMIT_PER_TURN + ADMIT_PER_TURN // 2
    dropped = set(range(total - 20, total))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    finished_before = sum(engine.get_stats().finished_by_reason.values())
    seen: list[int] = []  # requests the engine holds after each step

    def observe(_deltas: list, _now: float) -> None:
        s = engine.get_stats().scheduler
        seen.append(s.num_running + s.num_waiting)

    async def one(ae: AsyncEngine, i: int) -> str | None:
        async for out in ae.generate([5 + i % 50, 7], params, f"flood-{i}"):
            if out.finished:
                return out.outputs[0].finish_reason
        return None

    async def run() -> list:
        ae = AsyncEngine(engine, observers=[observe])
        ae.start()
        try:
            tasks = [asyncio.create_task(one(ae, i)) for i in range(total)]
            await asyncio.sleep(0)  # every request is in the inbox
            for i in dropped:
                tasks[i].cancel()  # leaving the stream aborts the request
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await asyncio.to_thread(ae.stop)

    with one_thread():
        results = asyncio.run(run())
    assert all(results[i] == "length" for i in range(total) if i not in dropped)
    assert all(isinstance(results[i], asyncio.CancelledError) for i in dropped)
    growth = [b - a for a, b in zip([0, *seen], seen, strict=False)]
    assert seen and max(growth) <= ADMIT_PER_TURN, seen
    finished = sum(engine.get_stats().finished_by_reason.values()) - finished_before
    assert finished == total - len(dropped)  # the aborted ones were never admitted
