"""Saving a model folder that downstream tools take as it is: the model, its processing classes and
whatever else the caller writes, put in place atomically; and pushing exactly what a save wrote.

Every save records what it wrote in `featcal_manifest.json` (`MANIFEST_NAME`). Saving into a folder
replaces the files this save writes and the files the folder's previous manifest lists; nothing else
there is touched. A non-empty folder without a manifest (not an earlier save of this library) is
refused, naming what is in it, unless the caller passes ``overwrite=True``: then the files of this save
replace same-named ones and every other file stays. The manifest also records its writer (the command
and the base model, ``written_by``): an earlier save of another command or another base is replaced
only with ``overwrite=True``, and every replacement of an earlier save logs one line saying what it
replaced (the CLI prints it).

Everything is written into a temporary folder first, then put in place by renames only: a failure
while writing (a full disk, an interrupt) leaves the previous folder, or nothing, at the target, never a
partial one. The temporary folder is made inside an existing target (so a mount point, a Docker or
Kubernetes volume, works: no rename crosses file systems) and beside a target that is still to be
created (in the folder it is created in).

`check_output_dir` is the one rule for an output folder, used before any work (the CLI, recipes) and
again at the save: writable (a probe file in the folder, or in the nearest existing parent it will be
created in), not a file, not one of the run's inputs (nor inside one, nor holding one) and, unless
overwriting, empty or an earlier save.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from .interrupts import interrupts_deferred

logger = logging.getLogger(__name__)

#: What every save writes: the top-level entries it put in the folder (a later save replaces exactly
#: these), so that a save never deletes a file it did not write.
MANIFEST_NAME = "featcal_manifest.json"
_MANIFEST_FORMAT = 1

#: Files a model save writes (weights, shard indexes, configs, tokenizer / processor files, model card,
#: open_clip files, hf_featcal's own outputs). Used only to warn when ``overwrite=True`` leaves weight
#: files of another save beside the new ones; a save removes what a manifest lists, never by pattern.
MODEL_FOLDER_PATTERNS: tuple[str, ...] = (
    "*.safetensors", "*.index.json", "pytorch_model*.bin", "tf_model*.h5", "flax_model*.msgpack",
    "config.json", "generation_config.json", "README.md", ".gitattributes",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "tokenizer.model", "sentencepiece.bpe.model",
    "*.tiktoken", "chat_template.jinja", "chat_template.json", "additional_chat_templates",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "open_clip_config.json", "open_clip_pytorch_model.bin",
    "featcal_*", "post_merging_*",
)

#: Remote files a new upload replaces: the weight files and indexes transformers / open_clip write (shards
#: of an earlier upload that this one does not rewrite are deleted with them; other files are kept).
STALE_WEIGHT_PATTERNS: list[str] = [
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
    "open_clip_model.safetensors", "open_clip_pytorch_model.bin",
]

#: Prefix of the temporary entries a save or a push makes (inside or beside the target).
_TEMPORARY_PREFIX = ".featcal-"
#: a save's staging folder (inside an existing target) and where the entries it replaces wait meanwhile
_STAGING_TAG, _PREVIOUS_TAG = "saving-", "previous-"


def _is_weight_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in STALE_WEIGHT_PATTERNS)


class FolderError(ValueError):
    """An output folder a save cannot go to: ``argument`` names it (a parameter, a flag, a recipe key),
    ``reason`` says why; the message is the two together."""

    def __init__(self, argument: str, reason: str) -> None:
        self.argument = argument
        self.reason = reason
        super().__init__(f"`{argument}` {reason}")


class FolderTypeError(FolderError, TypeError):
    """An output folder given as something that is not a path."""


def check_writable_folder(path: str | os.PathLike, argument: str) -> str:
    """The one rule for "a folder can be written here", checked before any work and again at the save:
    `path` is absent or a folder, and the folder itself (when it exists) or else its nearest existing
    parent (where it will be created) accepts a new file — a probe file is written and removed there,
    which is also where a save stages its files. Raises TypeError / ValueError naming `argument`;
    returns the path as given (a string). Nothing is left behind."""
    if not isinstance(path, (str, os.PathLike)):
        raise FolderTypeError(argument, f"must be a folder path (str or os.PathLike), got {type(path).__name__}.")
    if not os.fspath(path):
        raise FolderError(argument, "must be a folder path, got an empty string.")
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FolderError(argument, f"{path!r} is a file, not a folder.")
    existing = os.path.realpath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise FolderError(argument, f"{path!r} cannot be created: {existing!r} is a file, not a folder.")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=_TEMPORARY_PREFIX + "write-check-"):
            pass
    except OSError as err:
        raise FolderError(argument, f"{path!r} is not writable: {existing!r}: {err.strerror or err}.") from None
    return path


def check_output_dir(
    output_dir: str | os.PathLike,
    argument: str = "output_dir",
    *,
    inputs: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    written_by: Mapping[str, str] | None = None,
) -> str:
    """The absolute target path (symlinks resolved), after checking that a save may go there: it is
    writable (`check_writable_folder`); it is not, does not lie inside and does not contain any local
    folder the run reads from (`inputs`: argument name → path; hub ids and in-memory models are
    skipped); and it is absent, empty, or an earlier save of this library (it holds `MANIFEST_NAME`)
    unless `overwrite` — an earlier save whose manifest records another writer than `written_by`
    (another command, or another base model: `same_writer`) only with `overwrite`. A save there that
    was killed between its renames is first finished or undone (`repair_interrupted_save`), so that the
    folder is judged as the one save it then holds. Raises TypeError / ValueError naming `argument`.
    Nothing is created."""
    check_writable_folder(output_dir, argument)
    given = os.fspath(output_dir)
    target = os.path.realpath(given)  # a symlinked output folder: fill what it points to
    if os.path.isdir(target):
        repair_interrupted_save(target)
    for name, source in (inputs or {}).items():
        if not isinstance(source, (str, os.PathLike)) or not os.fspath(source):
            continue
        source = os.fspath(source)
        if source.startswith("local-dir:"):  # open_clip's reference to a local folder
            source = source[len("local-dir:"):]
        if not os.path.exists(source):  # a hub id
            continue
        read = os.path.realpath(source)
        if not os.path.isdir(read):
            read = os.path.dirname(read)  # a file input (a dataset's arrow file): its folder is read
        if read == target:
            relation = "is"
        elif _inside(target, read):
            relation = "lies inside"
        elif _inside(read, target):
            relation = "contains"
        else:
            continue
        raise FolderError(
            argument, f"{given!r} {relation} the folder of `{name}` ({read!r}), which this run reads: "
            "saving there could replace its files. Choose an output folder outside every input."
        )
    if not overwrite and os.path.isdir(target):
        foreign = _foreign_entries(target)
        if foreign:
            shown = ", ".join(foreign[:8]) + (f", … ({len(foreign)} entries)" if len(foreign) > 8 else "")
            raise FolderError(
                argument, f"{given!r} is not empty and is not an earlier hf_featcal save (no {MANIFEST_NAME}); "
                f"it holds: {shown}. Choose an empty or new folder, or pass overwrite=True (CLI: --overwrite; "
                "recipe: overwrite: true) to write this save's files there; the other files are kept."
            )
        previous = read_writer(target)
        if written_by is not None and previous is not None and not same_writer(previous, written_by):
            raise FolderError(
                argument, f"{given!r} holds an earlier save {describe_writer(previous)}, and this save is "
                f"{describe_writer(written_by)}: replacing it needs overwrite=True (CLI: --overwrite; recipe: "
                "overwrite: true). Choose another folder to keep it."
            )
    return target


def read_writer(folder: str | os.PathLike) -> dict[str, str] | None:
    """What the manifest of the save in `folder` records of its writer (``command``, ``base``), or None
    (no manifest, or one written before writers were recorded)."""
    try:
        with open(os.path.join(os.fspath(folder), MANIFEST_NAME), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    writer = data.get("written_by") if isinstance(data, dict) else None
    if not isinstance(writer, dict) or not all(isinstance(v, str) for v in writer.values()):
        return None
    return dict(writer)


def same_writer(previous: Mapping[str, str], current: Mapping[str, str]) -> bool:
    """Whether two recorded writers are the same command on the same base (local paths compared resolved)."""
    def base(writer: Mapping[str, str]) -> str | None:
        value = writer.get("base")
        return os.path.realpath(value) if value and os.path.exists(value) else value

    return previous.get("command") == current.get("command") and base(previous) == base(current)


def describe_writer(writer: Mapping[str, str]) -> str:
    """"by `hf-featcal merge` of the base '...'" (what a manifest records of its writer)."""
    text = f"by `{writer.get('command', 'an unknown command')}`"
    return text + (f" of the base {writer['base']!r}" if writer.get("base") else "")


def _inside(path: str, folder: str) -> bool:
    """Whether `path` lies strictly inside `folder` (both absolute and resolved)."""
    return path != folder and os.path.commonpath([path, folder]) == folder


def _foreign_entries(target: str) -> list[str]:
    """Entries of an existing folder a save would have to refuse: everything when the folder holds no
    manifest (not a save of this library), nothing otherwise (an earlier save: its files are replaced,
    every other entry is kept)."""
    if read_manifest(target) is not None:
        return []
    return sorted(name for name in os.listdir(target) if not name.startswith(_TEMPORARY_PREFIX))


def read_manifest(folder: str | os.PathLike) -> list[str] | None:
    """The top-level entries the save in `folder` wrote (its manifest included), or None when the
    folder holds no readable manifest."""
    path = os.path.join(os.fspath(folder), MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(_plain_name(name) for name in files):
        return None  # damaged or not ours: never trusted to decide what is deleted
    return [*files, MANIFEST_NAME] if MANIFEST_NAME not in files else list(files)


def _plain_name(name: Any) -> bool:
    """A top-level entry name (no separator, no `..`): a manifest can only name entries of its folder."""
    return isinstance(name, str) and name not in ("", ".", "..") and os.sep not in name and "/" not in name


def _write_manifest(staging: str, written_by: Mapping[str, str] | None = None) -> None:
    files = sorted(name for name in os.listdir(staging) if name != MANIFEST_NAME)
    manifest: dict[str, Any] = {"format": _MANIFEST_FORMAT, "library": "hf_featcal", "files": files}
    if written_by is not None:
        manifest["written_by"] = dict(written_by)
    with open(os.path.join(staging, MANIFEST_NAME), "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2)
        handle.write("\n")


@contextlib.contextmanager
def atomic_folder(
    output_dir: str | os.PathLike,
    argument: str = "output_dir",
    *,
    inputs: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    written_by: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Yield an empty temporary folder; when the block finishes, a manifest of its entries is added and
    its content is put in place at `output_dir` by renames only (no data is written then). When the
    block raises, the temporary folder is removed and `output_dir` is left exactly as it was.

    `output_dir` is first checked by `check_output_dir` (with `inputs` and `overwrite`). A new
    `output_dir` is the temporary folder (made beside it) renamed: all or nothing. Into an existing
    folder (the temporary folder is made inside it: a mount point works), the entries the previous
    manifest lists and those this save writes are renamed aside, the new ones renamed in, then the old
    ones deleted; any other entry (yours, another process's) is left as it is.

    `written_by` (``command``, ``base``) is recorded in the manifest; an earlier save of another writer
    is replaced only with `overwrite` (`check_output_dir`). Replacing an earlier save logs one line on
    this module's logger (the CLI prints it) saying what was replaced."""
    target = check_output_dir(output_dir, argument, inputs=inputs, overwrite=overwrite, written_by=written_by)
    if os.path.isdir(target):
        staging = os.path.join(target, f"{_TEMPORARY_PREFIX}{_STAGING_TAG}{uuid.uuid4().hex[:12]}")
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = _sibling(target, "saving")
    os.mkdir(staging)  # with the usual permissions (tempfile.mkdtemp's would be private)
    try:
        yield staging
        _write_manifest(staging, written_by)
        _put_in_place(staging, target, argument, overwrite, written_by)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _sibling(target: str, purpose: str) -> str:
    """A fresh hidden name beside `target` (in the folder `target` is created in: renames are atomic)."""
    parent, name = os.path.split(target)
    return os.path.join(parent, f"{_TEMPORARY_PREFIX}{name}.{purpose}-{uuid.uuid4().hex[:12]}")


def _put_in_place(staging: str, target: str, argument: str, overwrite: bool,
                  written_by: Mapping[str, str] | None = None) -> None:
    if not os.path.exists(target):
        try:
            os.rename(staging, target)
            return
        except OSError:
            if not os.path.isdir(target):  # not created meanwhile by another process: a real failure
                raise
        # created meanwhile: checked as any existing folder, the files swapped in from a staging
        # folder inside it
        check_output_dir(target, argument, overwrite=overwrite, written_by=written_by)
        inner = os.path.join(target, f"{_TEMPORARY_PREFIX}{_STAGING_TAG}{uuid.uuid4().hex[:12]}")
        os.rename(staging, inner)  # same parent file system: the target was created beside it
        try:
            _swap_files(inner, target, overwrite, argument)
        except BaseException:
            shutil.rmtree(inner, ignore_errors=True)
            raise
        return
    else:
        check_output_dir(target, argument, overwrite=overwrite, written_by=written_by)  # changed since?
    replaced = read_manifest(target)
    writer = read_writer(target)
    _swap_files(staging, target, overwrite, argument)
    if replaced is not None:
        logger.info("Replaced the earlier save in %s (%s; %d files)", target,
                    describe_writer(writer) if writer else "by an earlier hf_featcal save", len(replaced))


def _previous_name(staging_name: str) -> str:
    return staging_name.replace(_STAGING_TAG, _PREVIOUS_TAG, 1)


def repair_interrupted_save(folder: str | os.PathLike) -> str | None:
    """Finish or undo a save into `folder` that was killed (SIGKILL, power loss: no `except` ran) between
    its renames, which leaves a folder that loads as neither save: the old save's entries partly in a
    hidden ``previous-`` folder, the new one's partly in its hidden ``saving-`` folder. Where every new
    entry was renamed in (the ``saving-`` folder is empty or gone), the new save is complete and the old
    entries are deleted; otherwise the new entries renamed in so far go back and the old ones are
    renamed back: the previous save, as it was. Called by `check_output_dir` (every save, and the checks
    before a run) and every load of a local folder (`hf_featcal.model_io`); nothing happens (one
    `listdir`) without such folders. Not for a folder another process is saving into right now. Returns
    "completed" / "restored" (also logged as a warning), or None when there was nothing to repair."""
    folder = os.fspath(folder)
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    outcome = None
    for previous_name in sorted(n for n in names if n.startswith(_TEMPORARY_PREFIX + _PREVIOUS_TAG)):
        previous = os.path.join(folder, previous_name)
        staging = os.path.join(folder, previous_name.replace(_PREVIOUS_TAG, _STAGING_TAG, 1))
        with interrupts_deferred():
            if not os.path.isdir(staging) or not os.listdir(staging):
                shutil.rmtree(previous, ignore_errors=True)  # the new save is all in place
                outcome = "completed"
            else:
                _roll_back(folder, staging, previous)
                outcome = "restored"
            shutil.rmtree(staging, ignore_errors=True)
        warnings.warn(
            f"{folder!r}: a save there was interrupted between its renames; "
            + ("its new files were all in place: the save is complete." if outcome == "completed"
               else "the previous save is restored as it was."), stacklevel=2,
        )
    return outcome


def _roll_back(folder: str, staging: str, previous: str) -> None:
    """The entries the killed save renamed in go back to `staging`, the old ones out of `previous`."""
    manifest = os.path.join(staging, MANIFEST_NAME)
    # the new save's entries: its manifest's list, from `staging` or (renamed in already) from the folder
    new = read_manifest(staging) if os.path.isfile(manifest) else read_manifest(folder)
    moved_in = [name for name in (new or []) if os.path.lexists(os.path.join(folder, name))
                and not os.path.lexists(os.path.join(staging, name))]
    for name in moved_in:
        os.rename(os.path.join(folder, name), os.path.join(staging, name))
    for name in os.listdir(previous):
        os.rename(os.path.join(previous, name), os.path.join(folder, name))
    os.rmdir(previous)


def _swap_files(staging: str, target: str, overwrite: bool, argument: str = "output_dir") -> None:
    """Rename aside the entries of `target` that the previous manifest lists or that this save
    rewrites, rename those of `staging` (a folder inside `target`) in, then delete the old ones; on a
    failure, rename everything back (SIGINT deferred meanwhile: see `interrupts_deferred`)."""
    new = os.listdir(staging)
    previous_save = read_manifest(target) or []
    present = set(os.listdir(target))
    added = sorted(name for name in new if name in present and name not in previous_save)
    if added and not overwrite and previous_save:  # files put beside the earlier save, named as this save's
        raise FolderError(
            argument, f"{target!r}: this save writes {added}, which the earlier save there did not write "
            "(they are someone else's). Move them, or pass overwrite=True (CLI: --overwrite; recipe: overwrite: true) "
            "to replace them."
        )
    old = [name for name in dict.fromkeys([*previous_save, *new]) if name in present]
    if overwrite:
        left = sorted(name for name in present if _is_weight_file(name) and name not in new and name not in old)
        if left:
            warnings.warn(
                f"overwrite=True: weight files this save does not write stay in {target!r}: {left} "
                "(remove them if they belong to another model: loaders may pick them up).", stacklevel=4,
            )
    # named after the staging folder, so that a save killed between the renames is found and repaired
    # (`repair_interrupted_save`)
    previous = os.path.join(target, _previous_name(os.path.basename(staging)))
    os.mkdir(previous)
    moved_out: list[str] = []
    moved_in: list[str] = []
    try:
        for name in old:
            os.rename(os.path.join(target, name), os.path.join(previous, name))
            moved_out.append(name)
        for name in new:
            os.rename(os.path.join(staging, name), os.path.join(target, name))
            moved_in.append(name)
    except BaseException:
        with interrupts_deferred():  # a second Ctrl-C waits until the folder is back as it was
            for name in reversed(moved_in):
                os.rename(os.path.join(target, name), os.path.join(staging, name))
            for name in reversed(moved_out):
                os.rename(os.path.join(previous, name), os.path.join(target, name))
            with contextlib.suppress(OSError):
                os.rmdir(previous)  # empty once everything is back (else it keeps the old files: never deleted)
        raise
    shutil.rmtree(previous, ignore_errors=True)
    os.rmdir(staging)


#: An absolute POSIX path in text, also after a scheme (open_clip's ``local-dir:/...``, ``file:///...``) but
#: not the second part of `owner/name`: redacted from what is pushed when its first component exists here.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~<>-])/(?!/)[^\s\"'`|,;)\]}>]+")
#: JSON files larger than this are not rewritten when pushed (weights indexes, tokenizers: no local paths).
_REDACT_JSON_LIMIT = 2 << 20


def _local_path(text: str) -> bool:
    """Whether `text` is an absolute path on this machine (its first component exists here)."""
    parts = text.split("/")
    return len(parts) > 1 and bool(parts[1]) and os.path.exists("/" + parts[1])


def _redacted(path: str) -> str:
    """What is published instead of a local path: its last component, marked as local."""
    return "<local>/" + (os.path.basename(path.rstrip("/")) or "")


def _redact_text(text: str) -> str:
    return _ABSOLUTE_PATH.sub(lambda m: _redacted(m.group(0)) if _local_path(m.group(0)) else m.group(0), text)


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return _redacted(value) if value.startswith("/") and _local_path(value) else _redact_text(value)
    if isinstance(value, list):
        return [_redact_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _redact_value(item) for key, item in value.items()}
    return value


def _public_copy(source: str, destination: str) -> None:
    """Put `source` (a file of a save) at `destination` for a push: the saved card, recipe and JSON
    files with local absolute paths replaced by ``<local>/<name>``; everything else linked (or copied
    where links cannot be made), never changed in the saved folder."""
    name = os.path.basename(source)
    if name.endswith((".md", ".yaml", ".yml", ".txt")) and os.path.getsize(source) <= _REDACT_JSON_LIMIT:
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
        with open(destination, "w", encoding="utf-8") as handle:
            handle.write(_redact_text(text))
        return
    if name.endswith(".json") and name != "tokenizer.json" and os.path.getsize(source) <= _REDACT_JSON_LIMIT:
        with open(source, encoding="utf-8") as handle:
            data = json.load(handle)
        public = _redact_value(data)
        if public != data:
            with open(destination, "w", encoding="utf-8") as handle:
                json.dump(public, handle, indent=2)
                handle.write("\n")
            return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


@contextlib.contextmanager
def push_staging(folder: str | os.PathLike) -> Iterator[str]:
    """A fresh folder holding exactly the entries the manifest of the save in `folder` lists (with local
    paths redacted, see `_public_copy`), to upload; removed afterwards. Made inside `folder` (so files
    are linked, not copied). Raises ValueError when `folder` holds no save of this library."""
    folder = os.fspath(folder)
    files = read_manifest(folder)
    if files is None:
        raise ValueError(
            f"{folder!r} holds no hf_featcal save ({MANIFEST_NAME} is missing or unreadable): nothing is pushed."
        )
    staging = os.path.join(folder, f"{_TEMPORARY_PREFIX}push-{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)
    try:
        for name in files:
            source = os.path.join(folder, name)
            if os.path.isdir(source):
                shutil.copytree(source, os.path.join(staging, name), copy_function=_public_copy)
            elif os.path.isfile(source):
                _public_copy(source, os.path.join(staging, name))
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload FeatCal-calibrated merged model",
) -> Any:
    """Create (if needed) the hub model repo `repo_id` (`private` as in `HfApi.create_repo`) and upload
    exactly the files of the save in `folder` (its manifest's; no other file of the folder, no local
    absolute path) in one commit; remote weight files of an earlier upload that this one does not write
    (stale shards) are deleted in the same commit. Returns `upload_folder`'s result. Refused first
    (`hf_featcal.hub.check_push_target`): no token, or `private` into an existing public repository."""
    from huggingface_hub import HfApi

    from .hub import check_push_target

    api = HfApi(token=token)
    check_push_target(repo_id, private=private, token=token, api=api)  # before anything is staged
    with push_staging(folder) as staging:
        api.create_repo(repo_id, private=private, exist_ok=True)
        return api.upload_folder(repo_id=repo_id, folder_path=staging, commit_message=commit_message,
                                 delete_patterns=STALE_WEIGHT_PATTERNS)


def save_processing_class(processing_class: Any, output_dir: str, model: nn.Module | None = None) -> list[str]:
    """Save `processing_class` (a tokenizer, image processor or processor; or a sequence of them) into
    `output_dir` with its own `save_pretrained`, so the folder loads with the Auto classes and
    `pipeline(...)`. Returns the class names saved.

    open_clip keeps its preprocessing in `open_clip_config.json` (written with the model when its open_clip
    config is known): its transforms and tokenizers, which have no `save_pretrained`, need nothing here.
    Anything else that cannot be saved is reported with a warning."""
    if processing_class is None:
        return []
    if isinstance(processing_class, (list, tuple)):
        return [saved for item in processing_class for saved in save_processing_class(item, output_dir, model)]
    if hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
        return [type(processing_class).__name__]
    if _recorded_with_model(processing_class, output_dir, model):
        return []
    warnings.warn(
        f"processing_class {type(processing_class).__name__} has no save_pretrained: it is not saved with the model.",
        stacklevel=3,
    )
    return []


def _recorded_with_model(processing_class: Any, output_dir: str, model: nn.Module | None) -> bool:
    """Whether the model files in `output_dir` already record `processing_class` (open_clip: a torchvision
    transform or an open_clip tokenizer, whose settings are in open_clip_config.json): the layer map's
    `records_processing`."""
    from .architectures import processing_recorded

    return processing_recorded(processing_class, output_dir, model)


def save_model_files(
    model: nn.Module, output_dir: str, *, processing_class: Any = None, layer_map: Any = None
) -> list[str]:
    """Write `model` the way its library loads it back (transformers: `save_pretrained`; open_clip:
    its own format) and its processing classes into `output_dir`; returns the processing classes saved.
    Used inside `atomic_folder`, by `FeatCalCalibrator.save_model` and the CLI alike."""
    if layer_map is None:
        from .architectures import LayerMap, layer_map_or_none

        layer_map = layer_map_or_none(model) or LayerMap()  # no map: a transformers model, save_pretrained
    layer_map.save_model(model, output_dir)
    return save_processing_class(processing_class, output_dir, model)


def processing_to_save(processing: Any) -> list[Any]:
    """From the CLI / recipes' processing classes (`ModelFamily.load_processing`): what is saved with the
    model — the CLIPProcessor (else the image processor) and the tokenizer; open_clip's
    ``(tokenizer, preprocess)`` pair (recorded in `open_clip_config.json`) as it is."""
    if processing is None:
        return []
    out: list[Any] = []
    processor = processing.get("processor")
    if isinstance(processor, tuple):
        return list(processor)
    if processor is not None:
        out.append(processor)
    elif processing.get("image") is not None:
        out.append(processing["image"])
    if processing.get("tokenizer") is not None:
        out.append(processing["tokenizer"])
    return out


__all__: Sequence[str] = [
    "MANIFEST_NAME",
    "FolderError",
    "MODEL_FOLDER_PATTERNS",
    "STALE_WEIGHT_PATTERNS",
    "atomic_folder",
    "check_output_dir",
    "check_writable_folder",
    "describe_writer",
    "push_folder",
    "push_staging",
    "read_manifest",
    "read_writer",
    "same_writer",
    "processing_to_save",
    "save_model_files",
    "save_processing_class",
]
