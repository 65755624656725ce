"""`conveyor chat`: an interactive chat on stdin/stdout that streams each reply as it is generated.

Lines read from stdin are user turns (a terminal or a pipe); `/exit`, `/quit` or end of input
leaves, `/reset` forgets the conversation. Replies are printed token by token.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from conveyor.engine.args import add_cli_args, add_sampling_cli_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat", help="interactive chat (streams replies; /exit to quit)",
        description="Chat with the model: type a message, the reply streams back. The conversation "
                    "is kept between turns. Commands: /reset forgets it, /exit (or end of input) quits. "
                    "Works with stdin from a pipe too.")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="system message (default: the chat template's own)")
    parser.add_argument("--stats", action="store_true",
                        help="after each reply, print its prompt/reply token counts and speed to stderr")
    add_sampling_cli_args(parser, max_tokens=256)
    add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from conveyor.engine.args import from_cli_args, sampling_params_from_cli_args
    from conveyor.engine.chat import chat_prompt
    from conveyor.engine.llm_engine import LLMEngine

    try:
        params = sampling_params_from_cli_args(args)
        engine = LLMEngine(from_cli_args(args))
    except ValueError as e:
        print(f"conveyor chat: error: {e}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    if interactive:
        print("Chatting with the model. /reset forgets the conversation, /exit quits.")
    for turn in itertools.count():
        if interactive:
            print(">>> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(start)
            continue
        history.append({"role": "user", "content": line})
        request_id = f"chat-{turn}"
        engine.add_request(request_id, chat_prompt(engine.tokenizer, history), params)
        started = time.perf_counter()
        try:
            out = _stream_reply(engine)
        except KeyboardInterrupt:
            engine.abort_request(request_id)
            history.pop()
            print("\n[interrupted]")
            continue
        if out.outputs[0].finish_reason == "ignored":
            history.pop()
            print(f"[ignored: {out.finish_message}; /reset starts over]")
            continue
        history.append({"role": "assistant", "content": out.outputs[0].text})
        if args.stats:
            n_out, seconds = len(out.outputs[0].token_ids), time.perf_counter() - started
            print(f"[prompt {len(out.prompt_token_ids)} tokens, reply {n_out} tokens, "
                  f"{n_out / seconds:.1f} tok/s, {out.outputs[0].finish_reason}]", file=sys.stderr)
    if interactive:
        print()
    return 0


def _stream_reply(engine):
    printed, final = 0, None
    while final is None:
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            if out.finished:
                final = out
    sys.stdout.write("\n")
    sys.stdout.flush()
    return final
