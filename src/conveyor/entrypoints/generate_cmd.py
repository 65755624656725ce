"""`conveyor generate`: complete one or more prompts offline and print the results (text or JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from conveyor.engine.args import add_cli_args, add_sampling_cli_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate completions for prompts",
        description="Generate completions for one or more prompts in one batch and print them.")
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several allowed)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the model's chat template")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (default: 1)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list (prompt, outputs with text, token_ids, finish_reason)")
    constraint = parser.add_argument_group(
        "structured outputs", "constrain every output (one of these; docs/structured_outputs.md)"
    ).add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE",
                            help="a JSON schema file the output must validate against")
    constraint.add_argument("--json-object", action="store_true",
                            help="the output is a JSON object")
    constraint.add_argument("--regex", help="a regular expression the output must match")
    constraint.add_argument("--choice", nargs="+", metavar="TEXT",
                            help="the output is exactly one of these strings")
    constraint.add_argument("--grammar", metavar="FILE",
                            help="an EBNF grammar file (xgrammar's GBNF dialect)")
    add_sampling_cli_args(parser)
    add_cli_args(parser)
    parser.set_defaults(func=run)


def _structured_outputs(args: argparse.Namespace):  # -> StructuredOutputsParams | None
    from conveyor.core.structured_outputs_params import StructuredOutputsParams

    def read(path: str, flag: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from e

    if args.json_schema:
        return StructuredOutputsParams(json=read(args.json_schema, "--json-schema"))
    if args.grammar:
        return StructuredOutputsParams(grammar=read(args.grammar, "--grammar"))
    if args.json_object:
        return StructuredOutputsParams(json_object=True)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    return None


def run(args: argparse.Namespace) -> int:
    from conveyor.engine.args import from_cli_args, sampling_params_from_cli_args
    from conveyor.engine.llm import LLM

    try:
        params = sampling_params_from_cli_args(args, n=args.n)
        constraint = _structured_outputs(args)
        params = dataclasses.replace(params, structured_outputs=constraint)
        engine_args = from_cli_args(args)
        llm = LLM(**vars(engine_args))
        if constraint is not None:  # the compiler's verdict before any generation
            llm.llm_engine.structured_outputs.compile_cache.compile(constraint)
        if args.chat:
            conversations = [[{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(conversations, params, use_tqdm=sys.stderr.isatty())
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=sys.stderr.isatty())
    except ValueError as e:
        print(f"conveyor generate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([_as_dict(prompt, out) for prompt, out in zip(args.prompts, outputs, strict=True)],
                         ensure_ascii=False, indent=2))
        return 0
    for prompt, out in zip(args.prompts, outputs, strict=True):
        print(f"### {prompt}")
        for c in out.outputs:
            if len(out.outputs) > 1:
                print(f"--- sample {c.index}")
            print(c.text if c.finish_reason != "ignored" else f"[ignored: {out.finish_message}]")
        print()
    return 0


def _as_dict(prompt: str, out) -> dict:
    return {
        "prompt": prompt,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "finish_message": out.finish_message,
        "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    for c in out.outputs],
    }
