"""What the ``hf-featcal`` commands share: the user-error type, option builders generated from the
recipe schema (`hf_featcal.schema`), the checks of sources, devices and output folders made before any
work, and progress-bar and warning control.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

# Heavy libraries (torch, transformers, datasets) and the modules that import them load inside the
# commands that need them, so that `hf-featcal --help` starts at once.
from ..families import ModelFamily, detect_family, get_family, no_family_reason

if TYPE_CHECKING:  # pragma: no cover
    from ..recipes import KeyChecker


PROG = "hf-featcal"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "hf_featcal")


class CLIError(Exception):
    """A usage error: the command line is wrong (printed without a traceback, exit status 2)."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


FORMATTER = argparse.RawDescriptionHelpFormatter


def task_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected TASK=VALUE, got {text!r}")
    task, value = text.split("=", 1)
    task, value = task.strip(), value.strip()
    if not task or not value:
        raise argparse.ArgumentTypeError(f"expected TASK=VALUE with both parts non-empty, got {text!r}")
    return task, value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


#: --device's help, the same on every command.
DEVICE_HELP = ("where to compute, e.g. cuda, cuda:1 or cpu (default: this process's GPU if one is available, else "
               "the CPU; as accelerate picks it, so torchrun / accelerate launch give each process its own)")


def add_common(parser: argparse.ArgumentParser, device_help: str | None = DEVICE_HELP) -> None:
    """The options every command takes, with the same defaults: --device (not for a command that computes
    nothing: ``device_help=None``), --quiet, --debug."""
    if device_help is not None:
        parser.add_argument("--device", help=device_help)
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars (the merge's, the calibration's, the scenarios' training, "
                             "transformers' and datasets')")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")


def default_output_dir(command: str) -> str:
    """Where a command without --output-dir writes: ``./outputs/<command>-<date>-<time>`` (a new folder per run,
    so a run never replaces another's files)."""
    import time

    return os.path.join("outputs", f"{command}-{time.strftime('%Y%m%d-%H%M%S')}")


def help_text(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings


def recipe_value(key: Any) -> Callable[[str], Any]:
    """An argparse ``type`` for the recipe key `key`: the text converted to the key's kind and checked
    by its declaration (`hf_featcal.schema.RecipeKey.check`), so a bad value exits 2 naming the flag."""

    def convert(text: str) -> Any:
        value: Any = text
        if key.kind == "int":
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        try:
            return key.check(value, optional=False)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = key.kind  # argparse names the type in some messages
    return convert


def add_recipe_options(
    parser: Any,
    section: str,
    names: Sequence[str] | None = None,
    *,
    dest_prefix: str = "",
    override: bool = False,
    required: Sequence[str] = (),
) -> None:
    """One flag per recipe key `names` of `section` (default: every key it declares), generated from
    its declaration in `hf_featcal.schema.RECIPE_SECTIONS`: flag name, type and check, help, default
    (the recipe's when `override`). The value is stored under ``dest_prefix + name``; None when not given."""
    from ..schema import families_note, recipe_keys

    declared = recipe_keys(section)
    for name in declared if names is None else names:
        key = declared[name]
        text = families_note(section, name) + key.help
        if override:
            text = f"override the recipe's {_join_key(section, name)}: {text}"
        elif name not in required:
            default = key.describe_default() if key.default is None else key.default
            if default not in (None, "null"):
                text += f" (default: {default})"
        if key.kind == "bool":  # a switch: given → True, absent → None (the recipe's or the default)
            parser.add_argument(key.flag, dest=dest_prefix + name, action="store_true", default=None,
                                help=help_text(text))
            continue
        kwargs: dict[str, Any] = {"dest": dest_prefix + name,
                                  "metavar": key.metavar or ("N" if key.kind == "int" else name.upper()),
                                  "help": help_text(text)}
        if key.kind not in ("model", "dataset"):  # those are resolved (local path or hub id) by the command
            kwargs["type"] = recipe_value(key)
        parser.add_argument(key.flag, required=name in required, **kwargs)


def _join_key(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def recipe_values(args: argparse.Namespace, section: str, dest_prefix: str) -> dict[str, Any]:
    """The recipe keys of `section` given on the command line (see `add_recipe_options`)."""
    from ..schema import recipe_keys

    return {name: getattr(args, dest_prefix + name) for name in recipe_keys(section)
            if getattr(args, dest_prefix + name, None) is not None}


def task_pairs(pairs: Sequence[tuple[str, str]], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for task, value in pairs:
        if task in out:
            raise CLIError(f"{option}: task {task!r} is given twice")
        out[task] = value
    return out


def key_checker() -> KeyChecker:
    from ..families import source_schemes
    from ..recipes import KeyChecker

    return KeyChecker(None, os.getcwd(), source_schemes())


def check_source(value: str, option: str, kind: str = "model") -> str:
    """A local path (made absolute) or a hub id; raises CLIError otherwise (before any download)."""
    from ..recipes import RecipeError

    try:
        return key_checker().source(value, option, kind=kind)
    except RecipeError as err:
        raise CLIError(str(err)) from None


def adapter_base(source: str | None) -> str | None:
    """For a local LoRA adapter folder (it holds adapter_config.json): the base it records ("" when none);
    None when `source` is not an adapter folder."""
    import json

    path = os.path.join(source, "adapter_config.json") if source else ""
    if not source or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            recorded = json.load(handle).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        recorded = None
    return recorded if isinstance(recorded, str) else ""


def check_not_adapter_base(source: str | None, option: str = "--base") -> None:
    """Refuse a LoRA adapter given where the model the experts were fine-tuned from is expected."""
    recorded = adapter_base(source)
    if recorded is None:
        return
    trained_on = f" (its adapter_config.json records {recorded!r})" if recorded else ""
    raise CLIError(f"{option}: {source!r} is a LoRA adapter, not a full model: {option} takes the model the experts "
                   f"were fine-tuned from, the one the adapter was trained on{trained_on}. Pass that model as "
                   f"{option} and the adapter as --expert TASK=ADAPTER")


def check_device(device: str | None) -> None:
    """Refuse a --device this machine cannot use (before anything is loaded)."""
    if device is None:
        return
    from ..devices import usable_device

    try:
        usable_device(device, "--device")
    except ValueError as err:
        raise CLIError(str(err)) from None


def check_output_dir(
    path: str, option: str = "--output-dir", *, inputs: dict[str, Any] | None = None, overwrite: bool = False,
    model_folder: bool = True, written_by: dict[str, str] | None = None,
) -> None:
    """Refuse, before merging or calibrating, an output folder the save would refuse (the run's
    `check_output_dir` stage: not writable, one of the `inputs` or inside / around one, non-empty and
    not an earlier save, or an earlier save of another command or base than `written_by`, unless
    `overwrite`); `model_folder=False`: writability only."""
    from ..recipes import RecipeError
    from ..recipes import check_output_dir as check_for_save

    try:
        check_for_save(path, option, inputs=inputs, overwrite=overwrite, model_folder=model_folder,
                       written_by=written_by)
    except RecipeError as err:
        raise CLIError(str(err)) from None


def check_push(repo_id: str | None, private: bool | None, option: str = "--push-to-hub") -> None:
    """Refuse, before any work, a push that cannot succeed: no token, or --private into an existing
    public repository (`hf_featcal.hub.check_push_target`)."""
    if not repo_id:
        return
    from ..hub import check_push_target

    try:
        check_push_target(repo_id, private=private, argument=option)
    except ValueError as err:
        raise CLIError(str(err).replace(f"`{option}`", option, 1)) from None


def check_output_file(path: str, option: str, inputs: dict[str, str | None] | None = None) -> None:
    """Refuse, before any work, a file path that is a folder, an existing file inside one of the local
    folders the command reads (`inputs`: option → source; writing there would replace a file of that
    model) or whose folder cannot be created and written (missing folders are created when the file is
    written)."""
    from ..saving import FolderError, check_writable_folder

    if os.path.isdir(path):
        raise CLIError(f"{option}: {path!r} is a folder; give a file path")
    target = os.path.realpath(path)
    for name, source in (inputs or {}).items():
        folder = os.path.realpath(source) if source and os.path.isdir(source) else None
        if folder is not None and os.path.isfile(target) and os.path.commonpath([target, folder]) == folder:
            raise CLIError(f"{option}: {path!r} is a file of the folder of {name} ({source!r}), which this command "
                           "reads: writing the scores there would replace it. Give a file path outside that folder")
    try:
        check_writable_folder(os.path.dirname(os.path.abspath(path)), option)
    except FolderError as err:
        raise CLIError(f"{option}: {path!r} cannot be written: {err.reason}") from None


def family_of(model: Any, given: str | None, option: str = "--model") -> ModelFamily:
    found = detect_family(model)
    if given is not None:
        if found is not None and found.name != given:
            raise CLIError(f"--family {given} does not match {option}, a {found.name!r} model ({type(model).__name__})")
        return get_family(given)
    if found is None:
        raise CLIError(f"{option}: {no_family_reason(model)}")
    return found


def first_processing(family: ModelFamily, candidates: Sequence[str | None]) -> dict[str, Any]:
    """The family's processing classes, each part from the first candidate folder / hub id that has it
    (`ModelFamily.processing_from`: e.g. a CLIP expert's image processor and the base's tokenizer)."""
    found = family.processing_from(candidates)
    if found is None:
        raise CLIError(f"no {family.processing_name} found (tried {[c for c in candidates if c]}); pass --processor")
    return found


def maybe_processing(family: ModelFamily | None, sources: Sequence[str | None]) -> dict[str, Any] | None:
    """The family's processing classes, each part from the first of `sources` that has it (None if none has)."""
    return None if family is None else family.processing_from(sources)


class ProgressBars:
    """With ``quiet``: no transformers / datasets / hub progress bars inside the block (restored after)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.restore: list[Callable[[], None]] = []

    def __enter__(self) -> ProgressBars:
        if not self.quiet:
            return self
        import datasets
        import huggingface_hub.utils as hub_utils
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            self.restore.append(hf_logging.enable_progress_bar)
        if datasets.is_progress_bar_enabled():
            datasets.disable_progress_bars()
            self.restore.append(datasets.enable_progress_bars)
        if not hub_utils.are_progress_bars_disabled():
            hub_utils.disable_progress_bars()
            self.restore.append(hub_utils.enable_progress_bars)
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in self.restore:
            undo()
        self.restore.clear()


def quiet_warnings() -> Any:
    """Hide FeatCal's per-module ridge warnings (summarised instead) while keeping others."""
    from ..calibrator import FeatCalWarning

    manager = warnings.catch_warnings(record=True)
    caught = manager.__enter__()
    warnings.simplefilter("always", FeatCalWarning)

    def finish() -> int:
        manager.__exit__(None, None, None)
        ridge = [w for w in caught if issubclass(w.category, FeatCalWarning)]
        for w in caught:
            if not issubclass(w.category, FeatCalWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return len(ridge)

    return finish
