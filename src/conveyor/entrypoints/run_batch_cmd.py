"""`conveyor run-batch -i in.jsonl -o out.jsonl`: an OpenAI batch input file run offline, on the
server's own routes in this process (no HTTP), one output line per input line in input order
(``response.status_code`` 200 with the answer, or the error status and body)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from conveyor.engine.args import add_cli_args

    p = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch input file offline",
        description="Run each line of an OpenAI batch input file ({custom_id, method, url, "
        "body}; url /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, "
        "/v1/score or /v1/rerank) and write the results as OpenAI's batch output JSONL.")
    p.add_argument("-i", "--input-file", required=True, help="the batch input (JSONL; - for stdin)")
    p.add_argument("-o", "--output-file", required=True,
                   help="where the results go (JSONL; - for stdout)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name the lines' 'model' may give (default: the model's)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="requests in the engine at once (default: 64)")
    add_cli_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from conveyor.entrypoints.openai.batch.lines import LineError, read_lines

    data = sys.stdin.buffer.read() if args.input_file == "-" else open(args.input_file, "rb").read()
    try:
        lines = read_lines(data)
    except LineError as e:
        raise SystemExit(f"{args.input_file}: {e}") from e
    if args.concurrency < 1:
        raise SystemExit("--concurrency must be >= 1")
    results = asyncio.run(_run_lines(args, lines))
    if results is None:
        return 1
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(text)
    failed = sum(1 for r in results if r["response"]["status_code"] != 200)
    print(f"{len(results) - failed} of {len(results)} requests succeeded", file=sys.stderr)
    return 0


async def _run_lines(args: argparse.Namespace, lines: list) -> list[dict] | None:
    from tqdm import tqdm

    from conveyor.engine.args import from_cli_args
    from conveyor.entrypoints.openai.app import build_app
    from conveyor.entrypoints.openai.batch.lines import run_line
    from conveyor.entrypoints.openai.state import ServerState

    state = ServerState(from_cli_args(args), args.served_model_name)
    app = build_app(state)
    await state.load()
    if state.load_error is not None:
        print(f"cannot load the model: {state.load_error}", file=sys.stderr)
        return None
    slots = asyncio.Semaphore(args.concurrency)
    progress = tqdm(total=len(lines), desc="requests", unit="req")

    async def one(line) -> dict:
        async with slots:
            _, record = await run_line(app, line, state.engine_args.queue)
        progress.update()
        return record

    try:
        return list(await asyncio.gather(*(one(line) for line in lines)))
    finally:
        progress.close()
        await state.close()
