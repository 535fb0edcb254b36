"""`FeatCalCalibrator`: the forward-order loop. Nothing architecture-specific lives here.

Pipeline per block: capture module inputs of the merged (student) and expert streams →
accumulate statistics per task → solve every selected module in closed form → write → propagate
the student stream through the calibrated block.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import reduce, send_to_device
from torch import Tensor, nn
from tqdm.auto import tqdm

from .architectures import LAYER_NORM, LINEAR, LayerMap, ModuleSpec, get_layer_map, model_config, supported_model_types
from .architectures.auto import infer_layer_map
from .checkpointing import CheckpointFolder, check_writable_folder, fingerprint
from .config import FeatCalConfig, matches_module_pattern
from .data import Batch, batch_size_of, prepare_batches
from .devices import usable_device
from .experts import ModelLike, ModelSource, make_source, module_device
from .hooks import capture_module_inputs, eval_mode, restore_on_failure
from .offload import ModelParameters
from .report import DriftReport, build_model_card
from .solver import (
    anchor,
    linear_objective_decrease,
    gram_is_singular,
    solve_layer_norm,
    solve_linear_bias,
    solve_linear_weights,
    solve_scale_only_norm,
)
from .statistics import LinearGroupStatistics, LinearTargets, NormStatistics
from .streams import StopForward, StreamBatch

logger = logging.getLogger(__name__)


class FeatCalWarning(UserWarning):
    """A module whose solution is set by the ridge rather than by the data."""


class FeatCalError(ValueError):
    """Calibration cannot go on (non-finite features or solutions); the model is left as it was."""


@dataclass
class _BlockPlan:
    """The selected modules of one block and how their statistics are grouped."""

    stack_index: int
    block_index: int
    specs: list[ModuleSpec]
    # set in the last block of a pooled-head stack: its non-key/value modules down-weight other tokens
    pooled_token_index: int | None
    # (captured input, pooled-token weighting, weight source) → modules sharing those statistics
    linear_groups: dict[tuple[str, bool, str], list[str]] = field(default_factory=dict)
    norms: list[tuple[str, bool]] = field(default_factory=list)  # (module, pooled)

    @property
    def capture_sources(self) -> list[str]:
        sources = {key[0] for key in self.linear_groups} | {name for name, _ in self.norms}
        return sorted(sources)


class FeatCalCalibrator:
    """Calibrate a merged model towards its experts with FeatCal, in a `Trainer`-like way.

    Args:
        model: the merged `PreTrainedModel`, or an open_clip `CLIP` / `VisionTransformer` (calibrated
            in place by `calibrate()`; left exactly as it was if calibration raises).
        base_model: the pre-trained model the experts were fine-tuned from (a model, local path or hub
            id), or None to anchor at the merged weights.
        experts: task name → expert (model, local path or hub id).
        calibration_data: task name → `datasets.Dataset` or an iterable of batches (dicts of tensors
            the model's forward accepts, used as given).
        config: a `FeatCalConfig` (defaults: the authors' demo settings).
        data_collator: turns a list of dataset rows into a batch (default: transformers'
            `default_data_collator`).
        processing_class: an image processor, a per-image transform (open_clip's `preprocess`) or a
            tokenizer, applied to dataset rows that lack the model's main input.
        accelerator: an `accelerate.Accelerator` whose device is used.
        device: an explicit device (overrides `accelerator`). Default: the accelerate state's device.
        merge_info: how the merged model was made (for the model card); default
            `model.config.hf_featcal_merge` (open_clip: `model.hf_featcal_merge`) when present.
        show_progress: show a progress bar per block.
        checkpoint_dir: persist progress there after every block; re-running with the same arguments
            after an interruption continues from the last finished block (same result as an
            uninterrupted run). A checkpoint of a different run is refused.
        allow_inferred_layer_map: for an architecture without a registered layer map, infer its
            blocks from `_no_split_modules` (with a warning naming what was found) instead of raising.

    All inputs are checked here, before any expensive work; errors name the offending argument.
    """

    def __init__(
        self,
        model: nn.Module,
        base_model: ModelLike | None = None,
        experts: Mapping[str, ModelLike] | None = None,
        calibration_data: Mapping[str, Any] | None = None,
        config: FeatCalConfig | None = None,
        data_collator: Callable[[list[dict]], Batch] | None = None,
        processing_class: Any = None,
        accelerator: Accelerator | None = None,
        device: str | torch.device | None = None,
        merge_info: dict[str, Any] | None = None,
        show_progress: bool = True,
        checkpoint_dir: str | os.PathLike | None = None,
        allow_inferred_layer_map: bool = False,
    ) -> None:
        if config is None:
            config = FeatCalConfig()
        if not isinstance(config, FeatCalConfig):
            raise TypeError(f"`config` must be a FeatCalConfig, got {type(config).__name__}.")
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be the merged model (a PreTrainedModel or a supported open_clip model), got {type(model).__name__}.")
        self.config = config
        self.model = model
        if allow_inferred_layer_map and model_type_of(model) not in supported_model_types():
            self.layer_map: LayerMap = infer_layer_map(model)
        else:
            self.layer_map = get_layer_map(model, "model")
        self.model_config = model_config(model)
        self.parameters = ModelParameters(model)
        # Processes (accelerate launch / torchrun): each takes a disjoint shard of every task's
        # batches; statistics are sums, reduced across processes before every solve.
        self.state = accelerator.state if accelerator is not None else _default_state()
        self.device = _resolve_device(accelerator, device, self.state)
        self.show_progress = show_progress
        self._compute_dtype = getattr(torch, config.compute_dtype)

        tasks = _check_tasks(experts, calibration_data)
        self.tasks = tasks
        self._plans = self._plan_blocks()

        # Models: load, then check that every tower matches the merged one.
        # Models given as folders / hub ids with safetensors are read one block at a time.
        # LoRA adapter experts are the base plus the adapter's deltas, also built per block.
        self.base: ModelSource | None = None if base_model is None else make_source(base_model, "base_model")
        self.experts: dict[str, ModelSource] = {
            task: make_source(experts[task], f"experts[{task!r}]", self.base) for task in tasks
        }
        for source in [*self.experts.values(), *([self.base] if self.base is not None else [])]:
            self._check_compatible(source)

        # Data: batches per task, non-empty, accepted by the merged model's input path.
        self.batches: dict[str, list[Batch]] = {}
        for task in tasks:
            batches = prepare_batches(
                task,
                calibration_data[task],
                main_input_name=self.layer_map.main_input_name,
                num_samples=config.num_samples_per_task,
                batch_size=config.batch_size,
                seed=config.seed,
                data_collator=data_collator,
                processing_class=processing_class,
            )
            if not batches:
                raise ValueError(f"calibration_data[{task!r}] is empty: FeatCal needs at least one example per task.")
            self.batches[task] = batches
        self.samples_per_task = {
            task: sum(batch_size_of(b, self.layer_map.main_input_name) for b in batches)
            for task, batches in self.batches.items()
        }
        self._check_batches_enter_model()
        # the layer map may group statistics by what the batches select (e.g. LLM response tokens)
        self.layer_map.observe_batches(self.batches)
        self._plans = self._plan_blocks()
        if checkpoint_dir is not None:
            check_writable_folder(checkpoint_dir, "checkpoint_dir")
        self.checkpoint_dir = checkpoint_dir
        # what shaped the batches and plans: a later change of these config fields is refused
        self._planned_config = copy.deepcopy(config.to_dict())
        self._data_digest = None if checkpoint_dir is None else fingerprint(
            [(f"{task}.{i}.{key}", value) for task, batches in self.batches.items()
             for i, batch in enumerate(batches) for key, value in sorted(batch.items()) if isinstance(value, Tensor)]
        )
        if self.state.num_processes > 1:
            rank, world = self.state.process_index, self.state.num_processes
            self.batches = {task: batches[rank::world] for task, batches in self.batches.items()}

        if merge_info is None:  # recorded by hf_featcal.merging on the config, or on a config-less model
            merge_info = getattr(getattr(model, "config", None), "hf_featcal_merge", None) or getattr(model, "hf_featcal_merge", None)
        self.merge_info = merge_info
        #: Saved with the model by `save_model` / `push_to_hub` (as `Trainer` saves its processing class).
        self.processing_class = processing_class
        self._report: DriftReport | None = None
        self._calibrated = False
        #: Seconds spent per stage of the last `calibrate()` (entering stacks, block forwards,
        #: statistics, solving, propagating, drift, checkpointing). Set `profile = True` to synchronise
        #: the device around each stage so GPU timings are exact.
        self.timings: dict[str, float] = {}
        self.profile = False
        #: One entry per solved Linear: block, module, solve method, damping and the exact decrease
        #: of its weight objective J(merged weight) − J(calibrated weight).
        self.solve_log: list[dict[str, Any]] = []

    # ================================================================== public API
    @property
    def report(self) -> DriftReport | None:
        """The drift report of the last `calibrate()` (None before, or with `report_drift=False`)."""
        return self._report

    def calibrate(self) -> nn.Module:
        """Run FeatCal and return the calibrated model (the merged model, updated in place)."""
        if self._calibrated:
            raise RuntimeError("calibrate() was already run on this calibrator; build a new one to calibrate again.")
        self._check_config_unchanged()
        names = self._parameter_names()
        with restore_on_failure(self.model, names, self.parameters), eval_mode(self.model, *self._reference_models()), torch.no_grad():
            if not self.parameters.dispatched:  # a dispatched model keeps its placement: its hooks onload each block
                self.model.to(self.device)
            report = self._sweep()
        self._report = report
        self._calibrated = True
        return self.model

    def save_model(self, output_dir: str | os.PathLike, *, processing_class: Any = None) -> None:
        """Save the calibrated model with its processing class, model card, drift report and FeatCal
        config in one folder (on the main process only), so that the folder loads as it is with the Auto
        classes, `pipeline(...)` and tools such as lm-evaluation-harness.

        Args:
            output_dir: the folder. It is written as a temporary sibling folder and renamed into place:
                a failure part-way leaves the previous folder (or none), never a partial one. In an
                existing folder the files of an earlier save (weights, shards, indexes, tokenizer, card:
                `hf_featcal.saving.MODEL_FOLDER_PATTERNS`) are replaced, none left stale; other files stay.
            processing_class: what to save beside the model (a tokenizer, image processor or
                processor, or a list of them); default: the calibrator's `processing_class`. open_clip's
                preprocessing is recorded in `open_clip_config.json` with the model.
        """
        from .saving import atomic_folder, save_model_files

        if not self._calibrated:
            raise RuntimeError("save_model() needs a calibrated model: call calibrate() first.")
        if not self.state.is_main_process:
            return
        card = self.create_model_card()  # before anything is written: an unreadable source fails here
        with atomic_folder(output_dir) as folder:
            save_model_files(
                self.model, folder, layer_map=self.layer_map,
                processing_class=self.processing_class if processing_class is None else processing_class,
            )
            self.config.save_pretrained(folder)
            if self._report is not None:
                self._report.save(folder)
            card.save(os.path.join(folder, "README.md"))

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload FeatCal-calibrated merged model",
        processing_class: Any = None,
    ) -> Any:
        """Upload what `save_model` writes to the hub in one commit (weight files of an earlier upload
        that this one does not write, e.g. stale shards, are deleted in the same commit)."""
        from huggingface_hub import HfApi

        from .saving import STALE_WEIGHT_PATTERNS

        if not self._calibrated:
            raise RuntimeError("push_to_hub() needs a calibrated model: call calibrate() first.")
        if not self.state.is_main_process:
            return None
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as staging:
            folder = os.path.join(staging, "model")
            self.save_model(folder, processing_class=processing_class)
            return api.upload_folder(
                repo_id=repo_id, folder_path=folder, commit_message=commit_message, delete_patterns=STALE_WEIGHT_PATTERNS
            )

    def create_model_card(self) -> Any:
        """The model card (a `huggingface_hub.ModelCard`) describing this calibration, with hub metadata
        for a merge (`base_model` = the merged models' hub ids, `base_model_relation: merge`,
        `pipeline_tag`, `library_name`, the base's license)."""
        from .report import describe_model, license_of, pipeline_tag_of

        def describe(source: ModelSource) -> Any:
            return describe_model(source.name, getattr(source, "model", None))

        base = None if self.base is None else describe(self.base)
        return build_model_card(
            model_class=type(self.model).__name__,
            library_name=self.layer_map.library_name,
            pipeline_tag=pipeline_tag_of(self.model),
            license=None if self.base is None else license_of(self.base.name, getattr(self.base, "model", None)),
            base=base,
            experts={task: describe(source) for task, source in self.experts.items()},
            samples_per_task=self.samples_per_task,
            featcal_config=self.config.to_dict(),
            report=self._report,
            merge_info=self.merge_info,
        )

    # ================================================================== checks
    def _check_compatible(self, source: ModelSource) -> None:
        argument = source.argument
        if model_type_of(source.config) == model_type_of(self.model_config):
            other_map = self.layer_map  # also an inferred one
        else:
            other_map = get_layer_map(source.config, argument)
        if type(other_map) is not type(self.layer_map):
            raise ValueError(
                f"`{argument}` has model_type {model_type_of(source.config)!r}, which does not match the merged "
                f"{type(self.model).__name__} (model_type {model_type_of(self.model_config)!r})."
            )
        ours, theirs = self.layer_map.compatibility(self.model_config), other_map.compatibility(source.config)
        diff = {k: (ours[k], theirs.get(k)) for k in ours if ours[k] != theirs.get(k)}
        if diff:
            detail = ", ".join(f"{k}: merged {a!r} vs {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"`{argument}` has a different configuration from the merged model ({detail}).")
        mine = {k: tuple(v.shape) for k, v in self.layer_map.tower(self.model).state_dict().items()}
        other_shapes = source.tower_shapes(other_map, self.model)
        missing = sorted(set(mine) - set(other_shapes))
        if missing:
            raise ValueError(f"`{argument}` lacks parameters of the merged model's tower: {missing[:5]}.")
        wrong = [k for k in mine if mine[k] != other_shapes[k]]
        if wrong:
            k = wrong[0]
            raise ValueError(
                f"`{argument}` has parameter shapes that differ from the merged model: {k} is "
                f"{other_shapes[k]} vs {mine[k]} (and {len(wrong) - 1} more)."
            )

    def _check_config_unchanged(self) -> None:
        """The config may be edited between construction and `calibrate()`: check it again, refuse a
        change of what shaped the batches, and plan the blocks again for the rest."""
        self.config.validate()
        now = self.config.to_dict()
        if now == self._planned_config:
            return
        for name in ("num_samples_per_task", "batch_size", "seed"):
            if now[name] != self._planned_config[name]:
                raise ValueError(
                    f"FeatCalConfig.{name} changed after the calibrator was built ({self._planned_config[name]!r} → "
                    f"{now[name]!r}); it shapes the calibration batches: build a new FeatCalCalibrator."
                )
        self._compute_dtype = getattr(torch, self.config.compute_dtype)
        self._plans = self._plan_blocks()
        self._planned_config = copy.deepcopy(now)

    def _check_batches_enter_model(self) -> None:
        """Every batch of every task, before any block is touched: the keys the layer map needs, tensors
        (not arrays or lists) of consistent batch size, integer token ids inside the vocabulary, a
        forward through the merged model's input path, and at least one weighted token per task."""
        tower = self.layer_map.tower(self.model)
        device = self._input_device(tower)
        vocabulary = _vocabulary_size(self.model)
        with eval_mode(self.model), torch.no_grad():
            for task, batches in self.batches.items():
                weighted = 0.0
                for index, batch in enumerate(batches):
                    where = f"calibration_data[{task!r}] batch {index}"
                    try:
                        self.layer_map.check_batch(self.model, batch)
                        _check_batch_tensors(batch, self.layer_map, self.model, vocabulary)
                    except ValueError as err:
                        raise ValueError(f"{where}: {err}") from None
                    try:
                        state = self.layer_map.enter_stack(tower, send_to_device(batch, device), 0, None)
                    except Exception as err:  # noqa: BLE001 - re-raised with the task and batch named
                        raise ValueError(
                            f"calibration_data[{task!r}]: the merged model cannot take its batches (batch {index}, "
                            f"keys {sorted(batch)}): {type(err).__name__}: {err}"
                        ) from err
                    if state.weights is not None:
                        weighted += float(state.weights.sum())
                if weighted <= 0:
                    raise ValueError(
                        f"calibration_data[{task!r}] has no weighted token: every position is padding (attention_mask 0) "
                        "or excluded (labels -100 / loss_mask 0), so there is nothing to calibrate on."
                    )

    def _plan_blocks(self) -> dict[tuple[int, int], _BlockPlan]:
        cfg, lm = self.config, self.layer_map
        stacks = lm.stacks(lm.tower(self.model))
        total_blocks = sum(len(s.blocks) for s in stacks)
        if cfg.layers_to_transform is not None:
            bad = [i for i in cfg.layers_to_transform if not -total_blocks <= i < total_blocks]
            if bad:
                raise ValueError(
                    f"FeatCalConfig.layers_to_transform has block indices {bad} outside the model's "
                    f"{total_blocks} blocks."
                )
        plans: dict[tuple[int, int], _BlockPlan] = {}
        all_names: set[str] = set()
        selected_any = False
        flat = 0
        for si, stack in enumerate(stacks):
            for bi, block in enumerate(stack.blocks):
                specs = lm.block_modules(block)
                all_names.update(n for s in specs for n in (s.name, *s.aliases))
                chosen = [
                    s
                    for s in specs
                    if cfg.block_selected(flat, total_blocks)
                    and cfg.module_selected(s.name, *s.aliases)
                    and (s.kind == LINEAR or cfg.calibrate_norms)
                ]
                selected_any |= bool(chosen)
                pooled = stack.pooled_token_index if bi == len(stack.blocks) - 1 else None
                plans[(si, bi)] = self._group(si, bi, chosen, pooled)
                flat += 1
        self._check_patterns(all_names)
        if not selected_any:
            raise ValueError(
                "FeatCalConfig selects no module to calibrate (check target_modules, exclude_modules, "
                f"layers_to_transform and calibrate_norms); block modules are: {sorted(all_names)}."
            )
        return plans

    def _check_patterns(self, names: set[str]) -> None:
        for argument in ("target_modules", "exclude_modules"):
            patterns = getattr(self.config, argument)
            if patterns is None:
                continue
            # a regex string is one pattern; a list is checked entry by entry
            entries = [patterns] if isinstance(patterns, str) else [[p] for p in patterns]
            for entry in entries:
                if not any(matches_module_pattern(entry, n) for n in names):
                    shown = entry if isinstance(entry, str) else entry[0]
                    raise ValueError(
                        f"FeatCalConfig.{argument} entry {shown!r} matches no module; block modules are: "
                        f"{sorted(names)}."
                    )

    def _group(self, si: int, bi: int, specs: list[ModuleSpec], pooled: int | None) -> _BlockPlan:
        lm = self.layer_map
        plan = _BlockPlan(si, bi, specs, pooled)
        by_name = {s.name: s for s in specs}
        for spec in specs:
            weighted = pooled is not None and spec.name not in lm.key_value_modules
            if spec.kind != LINEAR:
                plan.norms.append((spec.name, weighted))
                continue
            # modules reading one captured input share statistics: the same capture point, or a
            # shared-input group of the layer map (captured at its first selected member)
            group = next((g for g in lm.shared_input_groups if spec.name in g), (spec.name,))
            source = by_name[next(n for n in group if n in by_name)].capture
            key = (source, weighted, lm.weight_source(spec.name))
            plan.linear_groups.setdefault(key, []).append(spec.name)
        return plan

    # ================================================================== the sweep
    def _reference_models(self) -> list[nn.Module]:
        sources = [*self.experts.values(), *([self.base] if self.base is not None else [])]
        return [model for source in sources for model in source.modules_for_eval()]

    def _parameter_names(self) -> list[str]:
        """Qualified names of every parameter FeatCal may write."""
        return [name for si, bi in self._plans for name in self._block_parameter_names(si, bi)]

    def _tower_parameter_names(self) -> list[str]:
        tower_params = {id(p) for p in self.layer_map.tower(self.model).parameters()}
        return [name for name, p in self.model.named_parameters() if id(p) in tower_params]

    def _input_device(self, tower: nn.Module) -> torch.device:
        """Where the merged model's inputs go: its own device, or for a dispatched model the compute
        device (accelerate's hooks move them on)."""
        return self.device if self.parameters.dispatched else module_device(tower)

    def _block_parameter_names(self, si: int, bi: int) -> list[str]:
        block = self.layer_map.stacks(self.layer_map.tower(self.model))[si].blocks[bi]
        names: dict[str, None] = {}  # ordered set: packed specs share their parameters
        for spec in self._plans[(si, bi)].specs:
            module = block.get_submodule(spec.owner)
            names.update((self.parameters.qualified_name(module, attr), None) for attr in spec.attributes(block))
        return list(names)

    def _enter(
        self, source: ModelSource | None, stack_index: int, previous: dict[str, list[StreamBatch]] | None, task: str
    ) -> list[StreamBatch]:
        """Each batch of a stream entering a stack: through the merged model (`source` None) or a source's own input path."""
        states = []
        entry = contextlib.nullcontext(self.layer_map.tower(self.model)) if source is None else source.entry_tower(self.layer_map, self.model)
        with entry as tower:
            merged_tower = tower is self.layer_map.tower(self.model)  # also for experts read from files
            source_device = self._input_device(tower) if merged_tower else module_device(tower)
            for b, batch in enumerate(self.batches[task]):
                prev = None if previous is None else send_to_device(previous[task][b], source_device)
                state = self.layer_map.enter_stack(tower, send_to_device(batch, source_device), stack_index, prev)
                states.append(self._park(state))
        return states

    def _sweep(self) -> DriftReport | None:
        cfg, lm = self.config, self.layer_map
        tower = lm.tower(self.model)
        stacks = lm.stacks(tower)
        total = sum(len(s.blocks) for s in stacks)
        report = {task: {"before": [], "after": []} for task in self.tasks} if cfg.report_drift else None
        student: dict[str, list[StreamBatch]] | None = None
        expert: dict[str, list[StreamBatch]] | None = None
        given: dict[str, list[StreamBatch]] | None = None
        checkpoint = self._checkpoint_folder()
        resume = checkpoint.load() if checkpoint is not None else None
        done = 0
        if resume is not None:
            done = resume.finished_blocks
            for name, value in resume.parameters.items():
                self.parameters.write(name, value)
            student, expert, given = resume.streams["student"], resume.streams["expert"], resume.streams["given"]
            report = resume.streams["report"]
            self.solve_log = resume.streams["solve_log"]
            logger.info("resuming from %s after block %d of %d", checkpoint.path, done, total)
        progress = tqdm(total=total, initial=done, desc="FeatCal", disable=not self.show_progress, unit="block")
        flat = 0
        try:
            for si, stack in enumerate(stacks):
                first = flat + 1
                if done >= flat + len(stack.blocks):  # the whole stack was finished before
                    flat += len(stack.blocks)
                    continue
                if done < first:  # streams enter this stack (a resumed run may bring the previous stack's)
                    progress.set_postfix_str(f"entering {stack.name}")
                    with self._timed("entering stacks"):
                        student = {t: self._enter(None, si, student, t) for t in self.tasks}
                        expert = {t: self._enter(self.experts[t], si, expert, t) for t in self.tasks}
                        if report is not None:
                            given = {t: (student[t] if si == 0 else self._enter(None, si, given, t)) for t in self.tasks}
                for bi, block in enumerate(stack.blocks):
                    flat += 1
                    if flat <= done:
                        continue
                    plan = self._plans[(si, bi)]
                    student, expert, given = self._calibrate_block(plan, block, student, expert, given, report, progress, f"{flat}/{total}")
                    if checkpoint is not None:
                        progress.set_postfix_str(f"({flat}/{total}) checkpointing")
                        with self._timed("checkpointing"):
                            checkpoint.save(
                                flat,
                                self.parameters.named(self._block_parameter_names(si, bi)),
                                {"student": student, "expert": expert, "given": given, "report": report, "solve_log": self.solve_log},
                                self.state.wait_for_everyone,
                            )
                    progress.update(1)
        finally:
            progress.close()
        return None if report is None else DriftReport(report)

    def _checkpoint_folder(self) -> CheckpointFolder | None:
        if self.checkpoint_dir is None:
            return None
        digest = fingerprint(
            [
                ("config", self.config.to_dict()),
                ("layer_map", type(self.layer_map).__name__),
                ("processes", self.state.num_processes),
                ("tasks", self.tasks),
                ("data", self._data_digest),
                ("merged", self.parameters.named(self._tower_parameter_names())),
                *[(f"expert.{task}", source.digest(self.layer_map, self.model)) for task, source in self.experts.items()],
                ("base", None if self.base is None else self.base.digest(self.layer_map, self.model)),
            ]
        )
        return CheckpointFolder(self.checkpoint_dir, digest, self.state.process_index, self.state.is_main_process, self.device)

    def _calibrate_block(
        self,
        plan: _BlockPlan,
        block: nn.Module,
        student: dict[str, list[StreamBatch]],
        expert: dict[str, list[StreamBatch]],
        given: dict[str, list[StreamBatch]] | None,
        report: dict[str, dict[str, list[float]]] | None,
        progress: tqdm,
        position: str,
    ) -> tuple[dict, dict, dict | None]:
        lm = self.layer_map
        si, bi = plan.stack_index, plan.block_index
        calibrating = bool(plan.specs)
        linear_stats, norm_stats = self._new_statistics(plan, block) if calibrating else ({}, {})
        sources = plan.capture_sources
        last_source: str | None = None  # the last captured module in forward order, once seen
        new_student, new_expert, new_given = {}, {}, ({} if given is not None else None)
        for task in self.tasks:
            progress.set_postfix_str(f"({position}) {'collecting statistics' if calibrating else 'forwarding'} · {task}")
            with self._timed("loading expert blocks"):
                expert_block = self.experts[task].block(lm, self.model, si, bi, self.device)
                targets = self._expert_targets(plan, linear_stats, expert_block)
            new_student[task], new_expert[task] = [], []
            if new_given is not None:
                new_given[task] = []
            with (
                eval_mode(expert_block),
                lm.capture_context(block),
                lm.capture_context(expert_block),
                capture_module_inputs(block, sources) as xs,
                capture_module_inputs(expert_block, sources) as xe,
            ):
                for b, parked in enumerate(student[task]):
                    # the student's output of the uncalibrated block is only needed while it is also the
                    # merged-as-given stream, or when nothing is solved here; otherwise its forward can stop
                    # once the last module input is captured (the expert's must run on: it feeds the next block)
                    needed = not calibrating or (new_given is not None and given[task][b] is parked)
                    xs.stop_after = None if needed or last_source is None else last_source
                    with self._timed("block forwards"):
                        state = self._fetch(parked)
                        try:
                            out_student = self._park(lm.run_block(block, bi, state))
                        except StopForward:
                            out_student = None
                        xs.stop_after = None  # the merged-as-given stream below runs the block to its end
                        if calibrating and last_source is None and len(xs.order) == len(sources):
                            last_source = xs.order[-1]
                        out_expert = lm.run_block(expert_block, bi, self._fetch(expert[task][b]))
                    if calibrating:
                        with self._timed("statistics"):
                            self._accumulate(plan, linear_stats, norm_stats, xs, xe, state, targets)
                    new_expert[task].append(self._park(out_expert))
                    if new_given is not None:
                        # the merged model as given and the student coincide until a block is calibrated
                        same = given[task][b] is parked
                        with self._timed("drift (merged-as-given stream)"):
                            new_given[task].append(out_student if same else self._run(block, bi, given[task][b]))
                    if not calibrating:
                        new_student[task].append(out_student)
            if calibrating:
                with self._timed("statistics"):
                    self._finish_task(expert_block, linear_stats, norm_stats, targets)
        if calibrating:
            progress.set_postfix_str(f"({position}) solving")
            with self._timed("solving"):
                self._solve_and_write(plan, block, linear_stats, norm_stats)
            progress.set_postfix_str(f"({position}) propagating")
            with self._timed("propagating"):
                for task in self.tasks:
                    new_student[task] = [self._run(block, bi, state) for state in student[task]]
        if report is not None:
            with self._timed("drift (merged-as-given stream)"):
                for task in self.tasks:
                    report[task]["before"].append(self._drift(new_given[task], new_expert[task]))
                    report[task]["after"].append(self._drift(new_student[task], new_expert[task]))
        return new_student, new_expert, new_given

    @contextlib.contextmanager
    def _timed(self, stage: str):
        """Add the wall time of the body to `self.timings[stage]` (device-synchronised when profiling)."""
        if self.profile and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.profile and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start

    def _park(self, state: StreamBatch) -> StreamBatch:
        """Where a stream batch waits between blocks (`FeatCalConfig.stream_placement`)."""
        placement = self.config.stream_placement
        if placement == "accelerator":
            return state.to(self.device)
        state = state.to("cpu")
        return state.pin_memory() if placement == "pinned_cpu" and torch.cuda.is_available() else state

    def _fetch(self, state: StreamBatch) -> StreamBatch:
        """A parked stream batch on the compute device."""
        return state.to(self.device, non_blocking=self.config.stream_placement == "pinned_cpu")

    def _run(self, block: nn.Module, index: int, parked: StreamBatch) -> StreamBatch:
        return self._park(self.layer_map.run_block(block, index, self._fetch(parked)))

    def _reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Sum tensors across processes (identity on one process)."""
        if self.state.num_processes == 1:
            return tensors
        return reduce(tensors, reduction="sum")

    def _drift(self, merged: list[StreamBatch], expert: list[StreamBatch]) -> float:
        """Σ‖h_merged − h_expert‖₂ / N over the non-padding positions of all batches (all processes)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        for m, e in zip(merged, expert):
            m, e = self._fetch(m), self._fetch(e)
            mask = (m.weights > 0).to(torch.float64)
            total += ((m.hidden.double() - e.hidden.double()).norm(dim=-1) * mask).sum()
            count += mask.sum()
        total, count = self._reduce([total, count])
        return float(total / count)

    def _new_statistics(self, plan: _BlockPlan, block: nn.Module) -> tuple[dict, dict]:
        kw = {"dtype": self._compute_dtype, "device": self.device}
        linear = {}
        specs = {s.name: s for s in plan.specs}
        for key, names in plan.linear_groups.items():
            dim = specs[names[0]].shape(block)[1]
            outputs = sum(specs[n].shape(block)[0] for n in names)
            linear[key] = LinearGroupStatistics(tuple(names), dim, epsilon=self.config.epsilon, direct_rhs=outputs < dim, **kw)
        norms = {}
        for name, weighted in plan.norms:
            module = block.get_submodule(name)
            kind = next(s.kind for s in plan.specs if s.name == name)
            norms[(name, weighted)] = NormStatistics(
                name, module.weight.shape[0], centered=kind == LAYER_NORM, norm_eps=self.layer_map.norm_eps(module), **kw
            )
        return linear, norms

    def _accumulate(
        self, plan: _BlockPlan, linear: dict, norms: dict, xs: dict, xe: dict, state: StreamBatch, targets: dict
    ) -> None:
        alpha = self.config.teacher_alpha
        for (source, weighted, _), stats in linear.items():
            x_s = xs[source]
            x_t = torch.lerp(x_s.to(self._compute_dtype), xe[source].to(self._compute_dtype), alpha)
            stats.accumulate(x_s, x_t, self._module_weights(plan, stats.modules[0], weighted, state), targets)
        for (name, weighted), stats in norms.items():
            stats.accumulate(xs[name], self._module_weights(plan, name, weighted, state))

    def _module_weights(self, plan: _BlockPlan, name: str, weighted: bool, state: StreamBatch) -> Tensor:
        """Token weights of a module's input: padding 0, and in the last block of a pooled-head stack
        `final_block_token_weight` for every token but the pooled one (unless a key/value projection)."""
        weights = self.layer_map.input_weights(name, state)
        if not weighted:
            return weights
        factor = torch.full_like(weights, self.config.final_block_token_weight)
        factor[:, plan.pooled_token_index] = 1.0
        return weights * factor

    @staticmethod
    def _expert_targets(plan: _BlockPlan, linear: dict, expert_block: nn.Module) -> dict[str, LinearTargets]:
        """The task expert's parameters of every Linear being solved."""
        specs = {s.name: s for s in plan.specs}
        return {
            name: LinearTargets(specs[name].value(expert_block, "weight"), specs[name].value(expert_block, "bias"))
            for stats in linear.values()
            for name in stats.modules
        }

    def _finish_task(self, expert_block: nn.Module, linear: dict, norms: dict, targets: dict) -> None:
        for stats in linear.values():
            stats.finish_task(targets, self._reduce)
        for (name, _), stats in norms.items():
            module = expert_block.get_submodule(name)
            stats.finish_task(module.weight.detach(), getattr(module, "bias", None), self._reduce)

    def _solve_and_write(self, plan: _BlockPlan, block: nn.Module, linear: dict, norms: dict) -> None:
        cfg = self.config
        lam, eps, rho = cfg.lambda_ratio, cfg.epsilon, cfg.anchor_rho
        where = f"block {plan.block_index} of {self.layer_map.stacks(self.layer_map.tower(self.model))[plan.stack_index].name}"
        base_block = None
        if self.base is not None:
            base_block = self.base.block(self.layer_map, self.model, plan.stack_index, plan.block_index, self.device)

        specs = {s.name: s for s in plan.specs}

        def anchor_of(name: str, attr: str) -> Tensor:
            merged = self._read_spec(block, specs[name], attr).to(self.device, self._compute_dtype)
            base = None
            if base_block is not None:
                base = specs[name].value(base_block, attr).to(device=merged.device, dtype=self._compute_dtype)
            return anchor(merged, base, rho)

        updates: dict[str, dict[str, Tensor]] = {}
        for stats in linear.values():
            names = list(stats.modules)
            _check_finite(stats.gram_sum, f"features entering {where}, module {', '.join(names)}")
            if stats.weighted_tokens < stats.dim:
                warnings.warn(
                    f"{where}, modules {names}: {stats.weighted_tokens} weighted tokens for input dimension "
                    f"{stats.dim}; the solution there is set by the ridge.",
                    FeatCalWarning,
                    stacklevel=5,
                )
            elif gram_is_singular(stats.gram_sum):
                warnings.warn(
                    f"{where}, modules {names}: the input Gram is numerically singular; the solution in its "
                    "null directions is set by the ridge.",
                    FeatCalWarning,
                    stacklevel=5,
                )
            weights, info = solve_linear_weights(
                stats.gram_sum, [stats.rhs_sum[name] for name in names], [anchor_of(name, "weight") for name in names], lam, eps
            )
            for name, weight in zip(names, weights):
                old = self._read_spec(block, specs[name], "weight").to(self.device)
                decrease = linear_objective_decrease(stats.gram_sum, old, weight, lam, eps)
                self.solve_log.append(
                    {"block": where, "module": name, "method": info.method, "damping": info.damping, "objective_decrease": decrease}
                )
                logger.info(
                    "%s %s: objective J(merged) − J(calibrated) = %.4g (%s%s)", where, name, decrease, info.method,
                    f", damping {info.damping:.3g}" if info.damping else "",
                )
                update = {"weight": weight}
                if specs[name].value(block, "bias") is not None and cfg.calibrate_bias:
                    update["bias"] = solve_linear_bias(
                        weight, stats.bias_target_sum[name], stats.student_mean_sum, stats.scale_sum, anchor_of(name, "bias"), lam
                    )
                updates[name] = update
        for (name, _), stats in norms.items():
            module = block.get_submodule(name)
            _check_finite(stats.second_moment_sum, f"features entering {where}, module {name}")
            has_bias = getattr(module, "bias", None) is not None
            if stats.centered and has_bias:
                gamma, beta = solve_layer_norm(
                    stats.second_moment_sum, stats.mean_sum, stats.gamma_target_sum, stats.beta_target_sum,
                    stats.num_tasks, anchor_of(name, "weight"), anchor_of(name, "bias"), lam, eps,
                )
                updates[name] = {"weight": gamma, "bias": beta}
            else:
                updates[name] = {
                    "weight": solve_scale_only_norm(stats.second_moment_sum, stats.gamma_target_sum, anchor_of(name, "weight"), lam, eps)
                }
        for name, update in updates.items():
            for attr, value in update.items():
                _check_finite(value, f"solution for {where}, module {name}.{attr}")
        for name, update in updates.items():
            for attr, value in update.items():
                self._write_spec(block, specs[name], attr, value)

    def _read_spec(self, block: nn.Module, spec: ModuleSpec, attr: str) -> Tensor:
        """A spec's current weight or bias in the merged model (also where accelerate offloaded it)."""
        module = block.get_submodule(spec.owner)
        value = self.parameters.module_value(module, spec.weight_attr if attr == "weight" else spec.bias_attr)
        return value if spec.rows is None else value[spec.rows[0] : spec.rows[1]]

    def _write_spec(self, block: nn.Module, spec: ModuleSpec, attr: str, value: Tensor) -> None:
        """Write a spec's weight or bias; a packed spec replaces its rows of the shared parameter."""
        module = block.get_submodule(spec.owner)
        name = spec.weight_attr if attr == "weight" else spec.bias_attr
        if spec.rows is not None:
            packed = self.parameters.module_value(module, name).clone()
            packed[spec.rows[0] : spec.rows[1]] = value.to(device=packed.device, dtype=packed.dtype)
            value = packed
        self.parameters.set_module_value(module, name, value)


# ====================================================================== helpers
def model_type_of(model_or_config: Any) -> str | None:
    return getattr(getattr(model_or_config, "config", model_or_config), "model_type", None)


def _default_state() -> PartialState:
    # without a GPU, `cpu=True` lets accelerate set up gloo when launched with several processes
    return PartialState(cpu=not torch.cuda.is_available())


def _resolve_device(accelerator: Accelerator | None, device: str | torch.device | None, state: Any) -> torch.device:
    if device is not None:
        return usable_device(device, "`device`")
    if accelerator is not None:
        if not isinstance(accelerator, Accelerator):
            raise TypeError(f"`accelerator` must be an accelerate.Accelerator, got {type(accelerator).__name__}.")
        return accelerator.device
    return state.device


def _check_tasks(experts: Any, calibration_data: Any) -> list[str]:
    if not isinstance(experts, Mapping) or not experts:
        raise ValueError("`experts` must be a non-empty mapping task name → expert model, local path or hub id.")
    if not isinstance(calibration_data, Mapping) or not calibration_data:
        raise ValueError("`calibration_data` must be a non-empty mapping task name → Dataset or iterable of batches.")
    no_data = [t for t in experts if t not in calibration_data]
    no_expert = [t for t in calibration_data if t not in experts]
    if no_data:
        raise ValueError(f"tasks {no_data} have an expert in `experts` but no entry in `calibration_data`.")
    if no_expert:
        raise ValueError(f"tasks {no_expert} have data in `calibration_data` but no expert in `experts`.")
    return list(experts)


_TOKEN_KEYS = ("input_ids", "decoder_input_ids")
_MASK_KEYS = ("attention_mask", "token_type_ids", "decoder_attention_mask", "loss_mask", "labels")


def _vocabulary_size(model: nn.Module) -> int | None:
    """The number of rows of the model's input token embedding (None for models without one)."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embedding = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None


def _check_batch_tensors(batch: Mapping[str, Any], layer_map: LayerMap, model: nn.Module, vocabulary: int | None) -> None:
    """Cheap checks of one batch's model inputs (ValueError naming the key): tensors, one batch size,
    integer token ids in [0, vocabulary), labels -100 or token ids where the model reads them as targets."""
    main = layer_map.main_input_name
    size = batch_size_of(batch, main)
    keys = dict.fromkeys((*layer_map.input_names, *_TOKEN_KEYS, *_MASK_KEYS))
    for key in keys:
        if key not in batch or batch[key] is None or isinstance(batch[key], bool):
            continue
        value = batch[key]
        if not isinstance(value, Tensor):
            raise ValueError(
                f"{key!r} is a {type(value).__module__}.{type(value).__qualname__}, expected a torch.Tensor "
                "(convert it with torch.as_tensor)"
            )
        if value.dim() == 0 or value.shape[0] != size:
            raise ValueError(f"{key!r} has shape {tuple(value.shape)}, but {main!r} holds {size} examples")
    if main in _TOKEN_KEYS:
        for key in ("attention_mask", "token_type_ids"):
            mask = batch.get(key)  # a 2-D mask is per token (other ranks are custom attention masks)
            if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape != batch[main].shape:
                raise ValueError(f"{key!r} has shape {tuple(batch[key].shape)}, expected {main!r}'s {tuple(batch[main].shape)}")
    targets = "labels" in layer_map.required_batch_keys(model)  # labels are token ids (teacher forcing)
    for key in (*_TOKEN_KEYS, *(("labels",) if targets else ())):
        value = batch.get(key)
        if not isinstance(value, Tensor):
            continue
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{key!r} must hold integer token ids, got dtype {value.dtype}")
        ids = value[value != -100] if key == "labels" else value
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"{key!r} holds the negative token id {int(ids.min())}" + (" (only -100 marks ignored labels)" if key == "labels" else ""))
        if vocabulary is not None and ids.numel() and int(ids.max()) >= vocabulary:
            raise ValueError(f"{key!r} holds the token id {int(ids.max())}, outside the model's vocabulary of {vocabulary}")
    if main == "pixel_values" and isinstance(batch.get(main), Tensor) and not batch[main].is_floating_point():
        raise ValueError(f"'pixel_values' must be floating point, got dtype {batch[main].dtype}")


def _check_finite(value: Tensor, what: str) -> None:
    if not bool(torch.isfinite(value).all()):
        raise FeatCalError(f"non-finite values in the {what}; the model was left unchanged.")
