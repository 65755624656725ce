"""The official openai client against `conveyor serve`: sync and async, streaming and not,
completions and chat; greedy outputs equal LLM.generate / LLM.chat on the same engine settings."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from conveyor.core.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def expected_completions(llm, one_thread) -> list:
    with one_thread():
        return llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)


@pytest.fixture(scope="module")
def expected_chat(llm, one_thread):
    with one_thread():
        return llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)[0]


def test_models_and_health(server, client, model_name) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_completion_sync_matches_llm_generate(client, model_name, expected_completions) -> None:
    for prompt, expected in zip(PROMPTS, expected_completions, strict=True):
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0.0)
        want = expected.outputs[0]
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_completion_batch_of_prompts(client, model_name, expected_completions) -> None:
    r = client.completions.create(model=model_name, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                  temperature=0.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [e.outputs[0].text for e in expected_completions]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected_completions)


def test_completion_stream_sync_matches(client, model_name, expected_completions) -> None:
    stream = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                       temperature=0.0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = expected_completions[0].outputs[0]
    assert text == want.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_sync_matches_llm_chat(client, model_name, expected_chat) -> None:
    r = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                       max_completion_tokens=MAX_TOKENS, temperature=0.0)
    want = expected_chat.outputs[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(expected_chat.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.object == "chat.completion"


def test_async_client_stream_and_not(server, model_name, expected_completions,
                                     expected_chat) -> None:
    async def run() -> tuple[str, str, str, list]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        async with client:
            whole = await client.completions.create(model=model_name, prompt=PROMPTS[1],
                                                    max_tokens=MAX_TOKENS, temperature=0.0)
            chat_whole = await client.chat.completions.create(
                model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0)
            stream = await client.chat.completions.create(
                model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
                stream=True)
            chunks = [c async for c in stream]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        return whole.choices[0].text, chat_whole.choices[0].message.content, streamed, chunks

    text, chat_text, chat_streamed, chunks = asyncio.run(run())
    assert text == expected_completions[1].outputs[0].text
    assert chat_text == expected_chat.outputs[0].text
    assert chat_streamed == expected_chat.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == expected_chat.outputs[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_string_truncates(client, model_name, expected_completions) -> None:
    full = expected_completions[0].outputs[0].text
    stop = full.strip().split()[1]  # the second word of the greedy continuation
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0.0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]


def test_n_samples_seed_and_sampling_params(client, model_name) -> None:
    kwargs = dict(model=model_name, prompt=PROMPTS[1], max_tokens=8, n=3, temperature=1.0,
                  top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=0.5,
                  user="tester", extra_body={"top_k": 40, "min_p": 0.05, "ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert a.usage.completion_tokens == 3 * 8
    assert all(c.finish_reason == "length" for c in a.choices)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples


def test_logprobs(client, model_name, expected_completions, expected_chat) -> None:
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0.0, logprobs=3)
    lp = r.choices[0].logprobs
    n = len(expected_completions[0].outputs[0].token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == r.choices[0].text
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and sampled <= 0.0
        assert max(top.values()) == pytest.approx(sampled, abs=1e-4)  # greedy takes the top one
    c = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                       temperature=0.0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == len(expected_chat.outputs[0].token_ids)
    assert all(len(t.top_logprobs) == 2 for t in content)
    # a reply that ends on the end-of-turn token has that token's logprob too, not its text
    end = "<|im_end|>" if c.choices[0].finish_reason == "stop" else ""
    assert "".join(t.token for t in content) == c.choices[0].message.content + end


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client, model_name) -> None:
    """usage.prompt_tokens_details.cached_tokens: none for a prompt the server has not seen, its
    full blocks (16 tokens each) when the same prompt comes again; in completions and chat,
    whole and in the streamed final usage chunk."""
    system = "You are a careful assistant. " + "Rules: " + " ".join(
        f"rule {i} is to be kind;" for i in range(20)) + " (usage test)"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    final = [chunk for chunk in stream][-1]
    assert final.usage.prompt_tokens_details.cached_tokens == cached
    prompt = system + " Complete this:"
    whole = client.completions.create(model=model_name, prompt=[prompt, prompt], max_tokens=2)
    assert whole.usage.prompt_tokens_details.cached_tokens > 0  # the second shares the first's
    streamed = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                              stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 0
