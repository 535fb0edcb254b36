"""The model-family interface (`ModelFamily`) and its registry.

A layer map (`hf_featcal.architectures.base.LayerMap`) says *how FeatCal calibrates* an architecture
(and how its library saves it and embeds zero-shot prompts and images); a `ModelFamily` says how the
end-to-end tools handle it: how a model is recognised, which processing classes it is loaded and saved
with, which recipe / CLI data keys it takes, how its calibration rows are prepared, how it is evaluated
and what the score is called. The CLI (``hf-featcal``) and the recipes (`hf_featcal.recipes`) look a
family up here and never branch on its name.

This module imports no heavy library at import time (``hf-featcal --help`` reads the family names from
it); each method imports what it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ..schema import declare_families

if TYPE_CHECKING:  # pragma: no cover
    from ..recipes.spec import DatasetSpec, EvaluationSpec, KeyChecker

__all__ = [
    "FamilyUsageError",
    "ModelFamily",
    "detect_family",
    "family_names",
    "get_family",
    "image_family_names",
    "iter_families",
    "no_family_reason",
    "register_family",
    "source_schemes",
]


class FamilyUsageError(ValueError):
    """Options that do not fit the model family (the CLI prints it as a usage error, exit status 2)."""


class ModelFamily:
    """Everything the CLI, recipes and evaluation need to know about one family of models.

    Class attributes (data) describe the recipe / CLI schema of the family; the methods do the work
    that differs between families. Subclasses register themselves with `register_family`.
    """

    #: The ``model_family`` value of recipes and ``--family`` of the CLI.
    name: ClassVar[str]
    #: How error messages name a model of the family ("a CLIP").
    article_name: ClassVar[str]
    #: What `load_processing` looks for (named when none is found).
    processing_name: ClassVar[str] = "tokenizer"
    #: The headline score printed above evaluation tables.
    score_label: ClassVar[str]
    #: Scores are fractions shown in % (accuracy); False: shown as they are (perplexity).
    score_in_percent: ClassVar[bool] = True
    #: A lower score is better (perplexity); the table headers say so.
    lower_is_better: ClassVar[bool] = False
    #: Whether the family has a built-in evaluation (False: recipes take ``evaluation: false`` only).
    evaluates: ClassVar[bool] = True
    #: Why a family without evaluation has none (in the error of a recipe or ``hf-featcal evaluate``).
    no_evaluation_reason: ClassVar[str] = ""
    #: A longer form of `score_label` for `hf-featcal evaluate` (default: the same).
    score_description: ClassVar[str | None] = None
    #: Calibration images (zero-shot evaluation) rather than text.
    is_image: ClassVar[bool] = False
    #: Per-dataset keys the family adds to ``dataset``, ``config``, ``split``, ``num_examples``.
    calibration_data_keys: ClassVar[tuple[str, ...]] = ()
    #: Keys of one ``evaluation.datasets.<task>`` entry.
    evaluation_data_keys: ClassVar[tuple[str, ...]] = ("dataset", "config", "split")
    #: Which of the zero-shot keys (``class_names``, ``templates``, ``clip_model``) the family takes.
    evaluation_keys: ClassVar[tuple[str, ...]] = ()
    #: Default ``evaluation.batch_size`` / ``--batch-size`` of ``hf-featcal evaluate``.
    default_evaluation_batch_size: ClassVar[int] = 32
    #: Whether a dataset entry may leave ``split`` out (null).
    split_optional: ClassVar[bool] = False
    #: Reference schemes the family's model sources may carry, each to ``"hub"`` (a hub id follows)
    #: or ``"local"`` (a local path follows), e.g. open_clip's ``hf-hub:`` / ``local-dir:``.
    source_schemes: ClassVar[Mapping[str, str]] = {}

    # --------------------------------------------------------------------------------- models
    def matches(self, model_or_config: Any) -> bool:
        """Whether a model (or its config) belongs to this family."""
        raise NotImplementedError

    @property
    def evaluation_label(self) -> str:
        """The score label of ``hf-featcal evaluate``."""
        return self.score_description or self.score_label

    def score_heading(self, label: str | None = None) -> str:
        """The heading of a table of scores: the label (default `score_label`) with its unit or direction,
        e.g. ``"zero-shot top-1 accuracy (%)"``, ``"held-out perplexity (lower is better)"``."""
        text = label or self.score_label
        if self.score_in_percent:
            text += " (%)"
        return text + (" (lower is better)" if self.lower_is_better else "")

    # ----------------------------------------------------------------------------- processing
    def load_processing(self, source: str) -> dict[str, Any]:
        """The processing classes saved with `source` (hub id, folder), as a dict."""
        raise NotImplementedError

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        """What the calibrator applies to raw calibration rows."""
        raise NotImplementedError

    def load_processing_parts(self, source: str) -> dict[str, Any]:
        """The parts of the family's processing that `source` has (default: `load_processing` whole, or
        nothing when it fails); `processing_from` takes each part from the first source that has it."""
        try:
            return self.load_processing(source)
        except (OSError, ValueError, TypeError):
            return {}

    def assemble_processing(self, parts: Mapping[str, Any]) -> dict[str, Any]:
        """The processing dict from parts found in several sources (default: as they are)."""
        return dict(parts)

    def processing_from(self, sources: Sequence[str | None]) -> dict[str, Any] | None:
        """Each part of the family's processing from the first of `sources` that has it (e.g. a CLIP
        expert's image processor and the base's tokenizer); None when no source has any part."""
        parts: dict[str, Any] = {}
        for source in sources:
            if not source:
                continue
            for name, value in self.load_processing_parts(source).items():
                if value is not None and parts.get(name) is None:
                    parts[name] = value
        return self.assemble_processing(parts) if parts else None

    def processing_to_save(self, processing: Mapping[str, Any] | None) -> list[Any]:
        """What of `processing` is saved next to the model (`hf_featcal.saving`)."""
        from ..saving import processing_to_save

        return processing_to_save(processing)

    # ----------------------------------------------------------------------------- recipe data
    def complete_dataset_spec(
        self,
        v: KeyChecker,
        task: str,
        spec: DatasetSpec,
        entry: Mapping[str, Any],
        key: Callable[[str], str],
        substitute: Callable[[Any], Any],
        keys: Mapping[str, str],
        fallback: str,
    ) -> None:
        """Fill the family's fields of `spec` from a recipe entry (errors name ``key(field)``)."""

    def dataset_to_dict(self, spec: DatasetSpec, calibration: bool) -> dict[str, Any]:
        """The family's fields of a dataset spec, as a resolved recipe writes them."""
        return {}

    def default_evaluation_split(self, task: str) -> str:
        """The evaluation split of `task` (for text families, its GLUE task) when none is given."""
        raise NotImplementedError

    def inherit_from_calibration(self, entry: dict[str, Any], calibration: DatasetSpec) -> None:
        """Fields an evaluation entry takes over from the task's calibration spec."""

    def finish_evaluation_spec(self, v: KeyChecker, spec: DatasetSpec, entry: Mapping[str, Any], path: str) -> None:
        """Fields only evaluation datasets have."""

    def check_evaluation(
        self,
        v: KeyChecker,
        tasks: Sequence[str],
        class_names: Mapping[str, list[str]],
        templates: Mapping[str, list[str]],
    ) -> None:
        """Family checks of a recipe's ``evaluation`` section."""

    def evaluation_to_dict(self, evaluation: EvaluationSpec) -> dict[str, Any]:
        """The family's keys of a resolved recipe's ``evaluation`` section."""
        return {}

    # ----------------------------------------------------------------------------- calibration
    def prepare_calibration(self, task: str, ds: Any, spec: DatasetSpec, processing: Mapping[str, Any] | None) -> Any:
        """One task's calibration ``Dataset`` from its loaded, shuffled and cut rows."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ evaluation
    def check_evaluate_options(self, *, class_names: Mapping[str, Any], templates: Mapping[str, Any],
                               clip_model: str | None) -> None:
        """Refuse ``hf-featcal evaluate`` options the family does not take."""

    def evaluation_source(
        self,
        task: str,
        data: Mapping[str, str],
        configs: Mapping[str, str],
        class_names: Mapping[str, Any],
    ) -> tuple[str, str | None, str | None]:
        """(dataset, config, GLUE task or None) that ``hf-featcal evaluate --task TASK`` reads."""
        raise NotImplementedError

    def command_text_model(self, model: Any, clip_source: str | None, load: Callable[[str, str], Any]) -> Any:
        """``hf-featcal evaluate``: the model whose text tower builds zero-shot heads (None: the model's
        own, or no zero-shot evaluation)."""
        return None

    def recipe_text_model(
        self, base: Any, evaluation: EvaluationSpec, processing: dict[str, Any], load: Callable[[str, str], Any]
    ) -> tuple[Any, dict[str, Any]]:
        """A recipe's (text-tower model, processing) for evaluation (checked before merging)."""
        return None, processing

    def check_evaluation_processing(self, processing: Mapping[str, Any]) -> None:
        """``hf-featcal evaluate``: refuse processing classes evaluation cannot use."""

    def evaluate_whole_model(self, model: Any, spec: EvaluationSpec, *, processing: Mapping[str, Any],
                             device: Any = None) -> dict[str, Any]:
        """Scores not tied to an expert's task (e.g. lm-evaluation-harness tasks), as ``{name: details}``;
        {} when the family has none (the default)."""
        return {}

    def evaluate_task(
        self,
        model: Any,
        task: str,
        ds: Any,
        data_spec: DatasetSpec,
        spec: EvaluationSpec,
        *,
        processing: Mapping[str, Any],
        clip_model: Any = None,
        device: Any = None,
    ) -> tuple[float, dict[str, Any]]:
        """(headline score, details) of `model` on one task's loaded evaluation rows: a fraction in [0, 1]
        where `score_in_percent`, else the score as it is (perplexity)."""
        raise NotImplementedError


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(cls: type[ModelFamily]) -> type[ModelFamily]:
    """Class decorator: register a `ModelFamily` under its ``name`` (one instance)."""
    if not getattr(cls, "name", None):
        raise ValueError(f"{cls.__name__} needs a `name`")
    _FAMILIES[cls.name] = cls()
    declare_families(iter_families())  # the recipe schema's model_family choices and per-family notes
    return cls


def family_names() -> tuple[str, ...]:
    """Names of the registered families, sorted."""
    return tuple(sorted(_FAMILIES))


def image_family_names() -> tuple[str, ...]:
    """Names of the families calibrated on images and evaluated by zero-shot classification."""
    return tuple(name for name in family_names() if _FAMILIES[name].is_image)


def iter_families() -> list[ModelFamily]:
    """The registered families, in `family_names` order."""
    return [_FAMILIES[name] for name in family_names()]


def get_family(name: str) -> ModelFamily:
    """The family registered as `name`; KeyError names the known ones."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {list(family_names())}") from None


def source_schemes() -> dict[str, str]:
    """The model-source reference schemes of every registered family (`ModelFamily.source_schemes`)."""
    return {scheme: kind for family in iter_families() for scheme, kind in family.source_schemes.items()}


def no_family_reason(model: Any) -> str:
    """Why no registered family takes `model`, and what to do about it (for the CLI's and recipes' errors)."""
    from ..architectures import model_type_of, supported_model_types

    model_type = model_type_of(model)
    families = ", ".join(family_names())
    if model_type in supported_model_types():  # a layer map without a family: the family is what is missing
        return (f"model_type {model_type!r} has a layer map but no model family (families: {families}); add one: "
                "docs/architectures.md, 'Model families'")
    return (f"model_type {model_type!r} ({type(model).__name__}) has no layer map, so the command line has no model "
            f"family for it (families: {families}). Calibrate it from Python with FeatCalCalibrator(..., "
            "allow_inferred_layer_map=True), which infers its blocks (docs/architectures.md, 'Any other model'), or "
            "add a layer map and a family for it (docs/architectures.md)")


def detect_family(model_or_config: Any) -> ModelFamily | None:
    """The family of a model (or config), None when no registered family claims it."""
    for family in iter_families():
        if family.matches(model_or_config):
            return family
    return None
