"""The ``hf-featcal`` parser (one subparser per module of `COMMANDS`) and the entry point `main`, which
turns errors into one line on stderr: exit status 2 for a usage error (the command line or the recipe is
wrong), 1 for a run that failed (a model that does not fit, a file that cannot be read, a hub failure).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from ..families import FamilyUsageError
from . import calibrate, compare, demo, evaluate, merge, push, run
from ._common import FORMATTER, PROG, CLIError

__all__ = ["COMMANDS", "build_parser", "main"]

#: The commands, in the order ``hf-featcal --help`` lists them; a new command is a module with
#: ``register(commands)`` (adds its subparser, ``set_defaults(func=run)``) and a line here.
COMMANDS = (merge, calibrate, evaluate, run, push, demo, compare)

_MAIN_EPILOG = """\
examples:
  hf-featcal demo                                     # offline digits demo, < 3 min on 2 CPU cores
  hf-featcal run examples/recipes/clip_vit_b32_ta8.yaml
  hf-featcal compare --demo                           # merges × post-merging on the digits demo
  hf-featcal merge --base openai/clip-vit-base-patch32 \\
      --expert mnist=tanganke/clip-vit-base-patch32_mnist --expert svhn=tanganke/clip-vit-base-patch32_svhn \\
      --method ties --scaling-factor 0.3 --density 0.2 --output-dir merged
  hf-featcal calibrate --model merged --base openai/clip-vit-base-patch32 \\
      --expert mnist=tanganke/clip-vit-base-patch32_mnist --expert svhn=tanganke/clip-vit-base-patch32_svhn \\
      --data mnist=ylecun/mnist --data svhn=ufldl-stanford/svhn --data-config svhn=cropped_digits \\
      --output-dir merged-featcal
  hf-featcal evaluate --model merged-featcal --task mnist --task svhn --max-samples 1000
  hf-featcal push merged-featcal me/clip-vit-b32-mnist-svhn-featcal   # exactly the save's files

Every command runs offline with local folders (save_pretrained / Dataset.save_to_disk) in place of hub ids.
Model families: clip, open_clip, flan_t5, causal_lm (Llama, Mistral, Qwen2, Qwen3), bert (BERT, RoBERTa),
vit; a tiny offline Llama recipe: examples/recipes/tiny_llama_offline.yaml.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-featcal`` argument parser (one subparser per command)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="FeatCal for merged models: merge experts, calibrate the merge with FeatCal, evaluate, "
        "or run a whole YAML recipe.",
        epilog=_MAIN_EPILOG,
        formatter_class=FORMATTER,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ValueError, TypeError, OSError, ImportError, KeyError]
    try:
        from huggingface_hub.errors import HfHubHTTPError

        errors.append(HfHubHTTPError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-featcal``; returns the exit status (0 on success).

    Errors print one line ``hf-featcal <command>: error: ...`` on stderr. A usage error (an invalid option,
    recipe or path: argparse's, `CLIError`, `RecipeError`, `FamilyUsageError`) returns 2; a run that failed
    (``ValueError``, ``OSError``, ... raised while working: inputs that do not fit, unreadable files, hub
    failures) returns 1; Ctrl-C returns 130. ``--debug`` re-raises them with the traceback.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help / --version / usage errors
        return int(exit_.code) if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    from ..recipes import RecipeError  # after parsing: --help loads no recipe machinery
    command: Callable[[argparse.Namespace], int] = args.func
    name = f"{PROG} {args.command}"
    saves = logging.getLogger("hf_featcal.saving")  # its one line per replaced save, printed on stderr
    said = logging.StreamHandler(sys.stderr)
    said.setFormatter(logging.Formatter("%(message)s"))
    saves.addHandler(said)
    level = saves.level
    saves.setLevel(logging.INFO)
    try:
        return command(args)
    except (CLIError, RecipeError, FamilyUsageError) as err:
        if args.debug:
            raise
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as err:
        if args.debug:
            raise
        reason = " ".join(str(err).split())  # one line, whatever the message
        print(f"{name}: error: {type(err).__name__}: {reason} (--debug shows the traceback)", file=sys.stderr)
        return 1
    finally:
        saves.removeHandler(said)
        saves.setLevel(level)
