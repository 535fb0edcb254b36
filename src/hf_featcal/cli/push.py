"""``hf-featcal push FOLDER REPO``: upload exactly the files of a finished save to the hub."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import FORMATTER, CLIError, ProgressBars, add_common, log

_PUSH_EPILOG = """\
examples:
  hf-featcal push merged-featcal me/clip-vit-b32-ta8-featcal
  hf-featcal push merged-featcal me/clip-vit-b32-ta8-featcal --private

Uploads the files the save in FOLDER wrote (those its featcal_manifest.json lists; nothing else of the
folder), local absolute paths in the card, recipe and JSON files replaced by <local>/<name>, in one
commit; remote weight files of an earlier upload that this one does not write are deleted in it. Needs
a Hugging Face token (`hf auth login` or HF_TOKEN); with --private, the repository must be private or
new (an existing public one is refused, since the hub keeps its visibility).
"""


def register(commands: Any) -> None:
    """Add the command's subparser to `commands` (the parser's subparsers)."""
    p = commands.add_parser(
        "push", help="upload a finished save (merge, calibrate, run, demo) to the Hugging Face Hub",
        description="Upload exactly the files of an hf_featcal save to a hub model repository (created if needed).",
        epilog=_PUSH_EPILOG, formatter_class=FORMATTER,
    )
    p.add_argument("folder", metavar="FOLDER", help="the folder of a save (it holds featcal_manifest.json)")
    p.add_argument("repo", metavar="REPO", help="the hub repository, owner/name")
    p.add_argument("--private", action="store_true",
                   help="create the repository private; an existing public one is refused (the hub keeps its "
                        "visibility)")
    add_common(p, device_help=None)  # an upload computes nothing
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..recipes import push_run
    from ..saving import read_manifest
    from ..schema import recipe_key

    try:
        recipe_key("push_to_hub").check(args.repo, optional=False)
    except ValueError as err:
        raise CLIError(f"REPO: {err}") from None
    files = read_manifest(args.folder)
    if files is None:
        raise CLIError(f"FOLDER: {args.folder!r} holds no hf_featcal save (no readable featcal_manifest.json); "
                       "push a folder written by merge, calibrate, run or demo")
    with ProgressBars(args.quiet):
        pushed = push_run(args.folder, args.repo, private=args.private or None, log=log)
    print(f"Pushed the {len(files)} files of the save in {args.folder} to https://huggingface.co/{pushed}")
    return 0
