"""chat_multiturn: many multi-turn conversations behind one long shared system prompt, seeded.

Every turn's prompt is the whole conversation so far — the system prompt, each earlier user
message and assistant reply — plus a new user message; the next turn of a conversation is sent
after the previous answer, conversations interleave (``bench/chat_run.py``). The assistant
replies in the history are the workload's own tokens (as a trace replays them), so every system
and router measured sees byte-identical prompts; the server is asked for exactly that many
tokens (greedy, ``ignore_eos``).

Token ids are random from the ordinary part of the vocabulary, as the other workloads'
(``bench/workloads.py``). The defaults are sized for SmolLM2 on a CPU and for what the routers
can tell apart: the system prompt (1088 tokens, 68 blocks of 16) is longer than the window of
first blocks prefix_affinity hashes (64), so to that router every turn of every conversation
looks alike; the working set (``working_set_tokens``: the system prompt once plus each
conversation's own tokens) is several times one engine's KV pool of a few hundred blocks.
docs/kv_cache.md measures the routers, offload and disaggregation on it, and how the
shape decides their margins.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from conveyor.bench.workloads import FIRST_TOKEN_ID


@dataclass(frozen=True)
class ChatSpec:
    num_conversations: int = 32
    turns: tuple[int, int] = (6, 10)  # inclusive range of turns per conversation
    system_len: int = 1088  # tokens of the system prompt every conversation starts with
    user_len: tuple[int, int] = (128, 256)  # inclusive range of a user message's tokens
    reply_len: int = 32  # tokens of each assistant reply

    def __post_init__(self) -> None:
        if self.num_conversations < 1:
            raise ValueError(f"num_conversations must be >= 1, got {self.num_conversations}")
        for name in ("turns", "user_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if self.system_len < 0 or self.reply_len < 1:
            raise ValueError(f"system_len must be >= 0 and reply_len >= 1, got "
                             f"{self.system_len}, {self.reply_len}")


@dataclass(frozen=True)
class Turn:
    user: list[int]  # the new user message
    reply: list[int]  # the assistant's reply, as the conversation's history records it


@dataclass(frozen=True)
class Conversation:
    system: list[int]
    turns: list[Turn]

    def prompt(self, k: int) -> list[int]:
        """Turn ``k``'s prompt (0-based): the conversation so far plus its user message."""
        out = list(self.system)
        for t in self.turns[:k]:
            out += t.user + t.reply
        return out + self.turns[k].user

    @property
    def own_tokens(self) -> int:
        """Tokens of its own (not the shared system prompt) in its last turn's context."""
        return sum(len(t.user) + len(t.reply) for t in self.turns)


@dataclass(frozen=True)
class ChatWorkload:
    name: str
    seed: int
    spec: ChatSpec
    conversations: list[Conversation] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(c.prompt(k)) for c in self.conversations for k in range(len(c.turns)))

    @property
    def max_seq_len(self) -> int:
        return max(len(c.prompt(len(c.turns) - 1)) + self.spec.reply_len
                   for c in self.conversations)

    @property
    def working_set_tokens(self) -> int:
        """What a cache must hold for every turn to find its whole history: the system prompt
        once, plus every conversation's own tokens."""
        return self.spec.system_len + sum(c.own_tokens for c in self.conversations)

    def working_set_blocks(self, block_size: int) -> int:
        """``working_set_tokens`` in full KV blocks (each conversation's own blocks apart)."""
        shared = self.spec.system_len // block_size
        own = sum((self.spec.system_len + c.own_tokens) // block_size - shared
                  for c in self.conversations)
        return shared + own

    def describe(self, block_size: int, num_gpu_blocks: int | None = None) -> str:
        s = self.spec
        text = (f"{len(self.conversations)} conversations of {s.turns[0]}-{s.turns[1]} turns "
                f"({self.num_requests} requests), a {s.system_len}-token shared system prompt, "
                f"user messages of {s.user_len[0]}-{s.user_len[1]} tokens, {s.reply_len}-token "
                f"replies; working set {self.working_set_blocks(block_size)} blocks of "
                f"{block_size}")
        if num_gpu_blocks:
            text += (f" ({self.working_set_blocks(block_size) / num_gpu_blocks:.1f}x a "
                     f"{num_gpu_blocks}-block pool)")
        return text


def parse_chat_spec(text: str | None) -> ChatSpec:
    """``"num_conversations=4,turns=2-3,system_len=64,user_len=16-32,reply_len=8"`` (any of
    these keys; the rest keep ChatSpec's defaults) -> ChatSpec; ValueError for a bad one."""
    fields = {f.name: f for f in dataclasses.fields(ChatSpec)}
    values: dict[str, object] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep or key not in fields:
            raise ValueError(f"--chat-spec: expected KEY=VALUE with KEY one of "
                             f"{', '.join(fields)}, got {part!r}")
        try:
            if isinstance(getattr(ChatSpec, key), tuple):
                lo, _, hi = value.partition("-")
                values[key] = (int(lo), int(hi or lo))
            else:
                values[key] = int(value)
        except ValueError:
            raise ValueError(f"--chat-spec: {key} needs an integer or a range A-B, got "
                             f"{value!r}") from None
    return ChatSpec(**values)  # type: ignore[arg-type]


def make_chat_workload(vocab_size: int, seed: int = 0, spec: ChatSpec | None = None,
                       num_conversations: int | None = None) -> ChatWorkload:
    """The seeded workload (``num_conversations``: override the spec's count)."""
    spec = spec or ChatSpec()
    if num_conversations is not None:
        spec = ChatSpec(num_conversations, spec.turns, spec.system_len, spec.user_len,
                        spec.reply_len)
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    system = tokens(spec.system_len)
    conversations = []
    for _ in range(spec.num_conversations):
        turns = [Turn(tokens(rng.randint(*spec.user_len)), tokens(spec.reply_len))
                 for _ in range(rng.randint(*spec.turns))]
        conversations.append(Conversation(system, turns))
    return ChatWorkload("chat_multiturn", seed, spec, conversations)
