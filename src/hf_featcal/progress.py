"""Progress bars of the phases that have no ``show_progress`` argument of their own (a merge's per-tensor
loop, a scenario's training): they follow transformers' progress-bar switch, so one switch governs them
and the bars of the models and datasets they load. ``transformers.utils.logging.disable_progress_bar()``
hides them (``hf-featcal ... --quiet`` sets it); they are shown otherwise, on stderr."""

from __future__ import annotations

from typing import Any


def progress_enabled() -> bool:
    """Whether progress bars are on: transformers' switch (``enable_progress_bar`` / ``disable_progress_bar``)."""
    from transformers.utils import logging as hf_logging

    return bool(hf_logging.is_progress_bar_enabled())


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """A ``tqdm.auto.tqdm`` bar (same arguments), disabled when `progress_enabled` is false."""
    from tqdm.auto import tqdm

    return tqdm(*args, disable=not progress_enabled(), **kwargs)
