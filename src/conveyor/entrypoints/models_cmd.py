"""`conveyor pull REPO[:FILE|:QUANT]`, `conveyor list` and `conveyor rm REPO[:FILE|:QUANT]`: models
by Hugging Face repository name in huggingface_hub's cache (``conveyor/hub.py``)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    pull = subparsers.add_parser(
        "pull", help="download a model from the Hugging Face Hub into its cache",
        description="Download REPO (owner/name) into huggingface_hub's cache: its safetensors "
        "model, or the GGUF file a quantization tag (REPO:Q4_K_M) or file name (REPO:FILE) "
        "names. Downloads resume; every file is checked against the Hub's checksum and fetched "
        "again if it does not match. Then --model REPO[:...] loads it, offline too "
        "(HF_HUB_OFFLINE=1). HF_ENDPOINT names another Hub.")
    pull.add_argument("model", metavar="REPO[:FILE|:QUANT]")
    pull.set_defaults(func=_pull)
    listing = subparsers.add_parser("list", help="list the models in the Hugging Face cache",
                                    description="List the model repositories in "
                                    "huggingface_hub's cache: size and files.")
    listing.set_defaults(func=_list)
    rm = subparsers.add_parser("rm", help="delete a model from the Hugging Face cache",
                               description="Delete REPO from huggingface_hub's cache (with "
                               ":FILE or :QUANT, only the files that names).")
    rm.add_argument("model", metavar="REPO[:FILE|:QUANT]")
    rm.set_defaults(func=_rm)


def _ref(text: str):
    from conveyor.hub import parse_ref

    ref = parse_ref(text)
    if ref is None:
        raise SystemExit(f"{text!r} is not a Hugging Face repository (owner/name[:FILE|:QUANT])")
    return ref


def _pull(args: argparse.Namespace) -> int:
    from conveyor.hub import pull

    try:
        path = pull(_ref(args.model))
    except ValueError as e:
        raise SystemExit(str(e)) from e
    except Exception as e:  # network and Hub errors: say what failed, no traceback
        raise SystemExit(f"cannot pull {args.model}: {e}") from e
    print(path)
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _list(args: argparse.Namespace) -> int:
    from conveyor.hub import list_cached

    repos = list_cached()
    if not repos:
        print("no models in the Hugging Face cache", file=sys.stderr)
        return 0
    width = max(len(r["repo_id"]) for r in repos)
    for r in repos:
        print(f"{r['repo_id']:<{width}}  {_size(r['size']):>9}  {', '.join(r['files'])}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    from conveyor.hub import remove

    try:
        removed = remove(_ref(args.model))
    except ValueError as e:
        raise SystemExit(str(e)) from e
    print(f"removed {args.model}: {', '.join(removed)}")
    return 0
