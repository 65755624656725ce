"""Deterministic inference through `conveyor serve` (docs/determinism.md): the same temperature-0
chat request, twice non-streamed (the second from the prefix cache) and once streamed while
another request shares its batches, gives three identical texts."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
OTHER = [{"role": "user", "content": "Write a short poem about a lighthouse keeper."}]
MAX_TOKENS = 30


def test_same_chat_request_gives_identical_texts(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id

    def ask() -> str:
        r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.0,
                                           max_completion_tokens=MAX_TOKENS)
        return r.choices[0].message.content

    async def streamed_beside_another() -> str:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                     max_retries=0, timeout=120)

        async def stream() -> str:
            parts = []
            async for chunk in await aclient.chat.completions.create(
                    model=model, messages=MESSAGES, temperature=0.0,
                    max_completion_tokens=MAX_TOKENS, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            return "".join(parts)

        other = aclient.chat.completions.create(model=model, messages=OTHER, temperature=0.0,
                                                max_completion_tokens=2 * MAX_TOKENS)
        text, _ = await asyncio.gather(stream(), other)
        return text

    first, second = ask(), ask()
    streamed = asyncio.run(streamed_beside_another())
    assert first == second == streamed
    assert "rainbow" in first.lower()
