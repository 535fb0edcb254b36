"""`FeatCalCalibrator`: a thin facade over the stages of `hf_featcal.pipeline`.

It checks its arguments, loads the sources and batches, plans the blocks once, and runs the
forward-order block loop (`_sweep`, `_calibrate_block`): enter streams → capture + accumulate →
solve → write → (held-out guard) → propagate → drift → checkpoint. Each stage lives in a file of its own under
`hf_featcal/pipeline/` and shares a `RunContext` (device, dtype, timings, process group, logger);
nothing architecture-specific lives here.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from torch import Tensor, nn
from tqdm.auto import tqdm

from ._kernels.gemm import gemm_library, gram_kernel
from ._kernels.memory import reuse_freed_memory
from .architectures import LayerMap, get_layer_map, model_config, model_type_of, supported_model_types
from .architectures.auto import infer_layer_map
from .checkpointing import DigestBuilder
from .config import FeatCalConfig
from .data import Batch, batch_size_of, prepare_batches, text_length_limit
from .devices import usable_device
from .experts import ModelSource, make_source
from .hooks import eval_mode
from .model_io import ModelLike
from .parameters import ModelParameters
from .pipeline.accumulate import BlockStatistics
from .pipeline.capture import capture_block
from .pipeline.checkpoint import open_checkpoint, resume, save_block
from .pipeline.checks import (
    check_batches_enter_model,
    check_compatible,
    check_forward_dtype,
    check_not_empty,
    check_tasks,
)
from .pipeline.context import FeatCalError, FeatCalWarning, RunContext
from .pipeline.drift import (
    DriftLog,
    DriftSample,
    advance_given,
    advance_heldout_given,
    record_drift,
    record_heldout_drift,
    shared_with_student,
    student_batches_as_given,
)
from .pipeline.enter import enter_stack
from .pipeline.guard import guard_block, merged_values, split_heldout
from .pipeline.plan import BlockPlan, Plan, block_parameter_names, plan_blocks, select_modules
from .pipeline.propagate import propagate
from .pipeline.solve import solve_block
from .pipeline.steps import forward_order, module_steps
from .pipeline.streams import StreamBatch, Streams, TaskStreams
from .pipeline.write import BlockUpdates, write_block
from .report import DriftReport, build_model_card
from .restore import restore_on_failure
from .saving import check_writable_folder

__all__ = ["FeatCalCalibrator", "FeatCalError", "FeatCalWarning"]

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
            uninterrupted run). A checkpoint of a different run is refused, and so is one whose files
            changed since they were written (each is checked against a SHA-256 recorded then).
        allow_inferred_layer_map: for an architecture without a registered layer map, infer its
            blocks from `_no_split_modules` (with a warning naming what was found) instead of raising.

    All inputs are checked here, before any expensive work; errors name the offending argument.
    """

    def __init__(
        self,
        model: nn.Module,
        base_model: ModelLike | ModelSource | None = None,  # a ModelSource: opened already (hparam_search)
        experts: Mapping[str, ModelLike | ModelSource] | None = None,
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
            raise TypeError("`model` must be the merged model (a PreTrainedModel or a supported open_clip model), "
                            f"got {type(model).__name__}.")
        self.model = model
        if allow_inferred_layer_map and model_type_of(model) not in supported_model_types():
            layer_map: LayerMap = infer_layer_map(model)
        else:
            layer_map = get_layer_map(model, "model")
        self.model_config = model_config(model)
        self.parameters = ModelParameters(model)
        # Processes (accelerate launch / torchrun): each takes a disjoint shard of every task's
        # batches; statistics are sums, reduced across processes before every solve.
        self.state = accelerator.state if accelerator is not None else default_process_state()
        #: What every stage shares (device, accumulation dtype, timings, solve log, process group).
        self.context = RunContext(
            model=model, layer_map=layer_map, config=config, parameters=self.parameters, process=self.state,
            device=_resolve_device(accelerator, device, self.state), compute_dtype=getattr(torch, config.compute_dtype),
        )
        self.show_progress = show_progress

        tasks = check_tasks(experts, calibration_data)
        assert experts is not None and calibration_data is not None  # check_tasks refuses a missing mapping
        self.context.task_weights = config.normalised_task_weights(tasks)  # unknown names refused here
        gemm_library(), gram_kernel()  # a bad HF_FEATCAL_CPU_GEMM / _GRAM is refused here, before anything is loaded
        self.tasks = tasks
        self._calibration_data = {task: calibration_data[task] for task in tasks}  # for `input_folders`
        # the selection is checked before anything is loaded; it is grouped into plans once the
        # layer map has seen the batches
        selection = select_modules(self.layer_map, self.context.tower, config)

        # Models: load, then check that every tower matches the merged one.
        # Models given as folders / hub ids with safetensors are read one block at a time.
        # LoRA adapter experts are the base plus the adapter's deltas, also built per block.
        self.base: ModelSource | None = None if base_model is None else make_source(base_model, "base_model", layer_map)
        self.experts: dict[str, ModelSource] = {
            task: make_source(experts[task], f"experts[{task!r}]", layer_map, self.base) for task in tasks
        }
        for source in [*self.experts.values(), *([self.base] if self.base is not None else [])]:
            check_compatible(source, self.layer_map, model, self.model_config)
            source.check_finite(model)  # NaN/Inf named now, not found at a solve
        # fast mode's dtype against every model whose blocks run under it (folder experts take the merged dtype)
        in_memory = [(source.argument, module) for source in [*self.experts.values(), self.base] if source is not None
                     for module in source.modules_for_eval()]
        check_forward_dtype(config, [("model", model), *in_memory])

        # Data: batches per task, non-empty, accepted by the merged model's input path.
        #: task → this process's calibration batches (emptied once the streams have entered the last stack)
        self.batches: dict[str, list[Batch]] = {}
        #: task → the sizes of this process's calibration batches (kept when the batches are let go)
        self.batch_sizes: dict[str, list[int]] = {}
        self.samples_per_task: dict[str, int] = {}
        #: task → this process's held-out batches (`FeatCalConfig.heldout_fraction`; None: none held out),
        #: emptied as the calibration batches are
        self.heldout_batches: dict[str, list[Batch]] | None = {} if config.heldout_fraction > 0 else None
        #: task → held-out examples over all processes (None: none held out)
        self.heldout_per_task: dict[str, int] | None = {} if config.heldout_fraction > 0 else None
        text_max_length = text_length_limit(
            config.max_length, self.layer_map.tower_config(self.model_config), processing_class
        )
        rank, world = self.state.process_index, self.state.num_processes
        main_input = self.layer_map.main_input_name
        # the check runs the merged model's input path; where `calibrate()` will run it on the same
        # device, its result is kept as the student stream entering the first stack (each batch runs it once)
        device = self.context.input_device(self.context.tower)
        reuse = device == self.context.device
        # A one-stack tower whose plan does not depend on the batches takes each task's batches into
        # the streams as they are read: the task's expert and drift streams enter the stack here too and
        # its inputs (images: 0.6 MB each at 224², four times the stream they become) are let go, so the
        # inputs of every task are never held at once. Otherwise the batches wait for `calibrate()`.
        enter_now = (reuse and not self.layer_map.plans_from_batches
                     and len(self.layer_map.stacks(self.context.tower)) == 1)
        #: the streams entering the first stack, where they entered while the calibrator was built
        self._entered_streams: Streams | None = None
        if enter_now:
            self._entered_streams = (Streams({}, {}, {}) if self.heldout_batches is None
                                     else Streams({}, {}, {}, {}, {}, {}))
        entered: TaskStreams = {}
        digest = None if checkpoint_dir is None else DigestBuilder()
        samples: list[DriftSample] = []
        for task in tasks:
            batches = prepare_batches(
                task,
                calibration_data[task],
                main_input_name=main_input,
                num_samples=config.num_samples_per_task,
                batch_size=config.batch_size,
                seed=config.seed,
                data_collator=data_collator,
                processing_class=processing_class,
                max_length=text_max_length,
            )
            check_not_empty(task, batches)
            self.batches[task] = batches
            if self.heldout_batches is not None:  # split from every process's batches, before they are shared out
                calibration, heldout = split_heldout({task: batches}, config.heldout_fraction, config.seed, main_input)
                self.batches[task] = batches = calibration[task]
                self.heldout_batches[task] = heldout[task]  # shared out with the calibration batches (`_take_in`)
            self.samples_per_task[task] = sum(batch_size_of(b, main_input) for b in batches)
            del batches  # (not held while the next task's are read)
            if enter_now:
                self._take_in(task, entered, samples, digest, keep=lambda index: index % world == rank)
        if not enter_now:
            # the layer map may group statistics by what the batches select (e.g. LLM response tokens)
            self.context.layer_map = self.layer_map.for_batches(self.batches)
            for task in tasks:
                self._take_in(task, entered, samples, digest, keep=lambda index: reuse and index % world == rank)
        self._entered: tuple[torch.device, TaskStreams] | None = (device, entered) if reuse and not enter_now else None
        self._plans: Plan = plan_blocks(self.layer_map, selection)
        if checkpoint_dir is not None:
            check_writable_folder(checkpoint_dir, "checkpoint_dir")
        self.checkpoint_dir = checkpoint_dir
        # what shaped the batches and plans: a later change of these config fields is refused
        self._planned_config = copy.deepcopy(config.to_dict())
        self._data_digest = None if digest is None else digest.hexdigest()
        #: the examples the drift report measures (chosen from every process's batches, before they are shared out)
        self.drift_sample = DriftSample.union(samples)

        if merge_info is None:  # recorded by hf_featcal.merging on the config, or on a config-less model
            merge_info = (getattr(getattr(model, "config", None), "hf_featcal_merge", None)
                          or getattr(model, "hf_featcal_merge", None))
        self.merge_info = merge_info
        #: Saved with the model by `save_model` / `push_to_hub` (as `Trainer` saves its processing class).
        self.processing_class = processing_class
        self._report: DriftReport | None = None
        self._calibrated = False
        # by the streams' entry into the last stack (here already where they entered while it was built)
        self._batches_released = enter_now
        self._entered_device = device

    # ================================================================== shared run state
    @property
    def layer_map(self) -> LayerMap:
        """Where the merged model's tower, stacks and blocks are (the run context's, its one owner)."""
        return self.context.layer_map

    @property
    def config(self) -> FeatCalConfig:
        return self.context.config

    @config.setter
    def config(self, value: FeatCalConfig) -> None:
        self.context.config = value

    @property
    def device(self) -> torch.device:
        """Where blocks run and statistics accumulate."""
        return self.context.device

    @device.setter
    def device(self, value: torch.device) -> None:
        self.context.device = value

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent per stage of the last `calibrate()` (entering stacks, block forwards,
        statistics, solving, the held-out guard, propagating, drift, checkpointing). Set `profile = True` to synchronise
        the device around each stage so GPU timings are exact."""
        return self.context.timings

    @timings.setter
    def timings(self, value: dict[str, float]) -> None:
        self.context.timings = value

    @property
    def profile(self) -> bool:
        return self.context.profile

    @profile.setter
    def profile(self, value: bool) -> None:
        self.context.profile = value

    @property
    def solve_log(self) -> list[dict[str, Any]]:
        """One entry per solved Linear: block, module, solve method, damping and the exact decrease
        of its weight objective J(merged weight) − J(calibrated weight); with a held-out guard also
        `guard_gamma`, the blend its block was given (`guard_log`)."""
        return self.context.solve_log

    @solve_log.setter
    def solve_log(self, value: list[dict[str, Any]]) -> None:
        self.context.solve_log = value

    @property
    def guard_log(self) -> list[dict[str, Any]]:
        """With a held-out guard (`FeatCalConfig.guard`), one entry per calibrated block: `block`, the
        chosen `gamma`, the grid `gammas` and `heldout_head_drift` (task → the held-out relative drift
        under the head's token weights at each γ of the grid, summed over processes)."""
        return self.context.guard_log

    @property
    def _compute_dtype(self) -> torch.dtype:
        return self.context.compute_dtype

    # ================================================================== public API
    @property
    def report(self) -> DriftReport | None:
        """The drift report of the last `calibrate()` (None before, or with `report_drift=False`)."""
        return self._report

    def calibrate(self) -> nn.Module:
        """Run FeatCal and return the calibrated model (the merged model, updated in place)."""
        if self._calibrated:
            raise RuntimeError("calibrate() was already run on this calibrator; build a new one to calibrate again.")
        if self._batches_released and self._entered_streams is None:
            raise RuntimeError(
                "calibrate() was stopped on this calibrator after its calibration batches were released; build a new "
                "FeatCalCalibrator to calibrate again (with the same `checkpoint_dir` it resumes)."
            )
        self._check_config_unchanged()
        names = self._parameter_names()
        with (
            reuse_freed_memory(self.config.reuse_freed_cpu_memory and self.device.type == "cpu"),
            restore_on_failure(self.model, names, self.parameters, self.config.restore_snapshot),
            eval_mode(self.model, *self._reference_models()),
            torch.no_grad(),
            self.context.workspaces(),
        ):
            if not self.parameters.dispatched:  # a dispatched model keeps its placement: its hooks onload each block
                self.model.to(self.device)
            report = self._sweep()
        self._report = report
        self._calibrated = True
        if report is not None:
            _warn_rising_tasks(report)
        return self.model

    def save_model(self, output_dir: str | os.PathLike, *, processing_class: Any = None,
                   overwrite: bool = False) -> None:
        """Save the calibrated model with its processing class, model card, drift report and FeatCal
        config in one folder (on the main process only), so that the folder loads as it is with the Auto
        classes, `pipeline(...)` and tools such as lm-evaluation-harness.

        Args:
            output_dir: the folder. Checked first (`hf_featcal.saving.check_output_dir`): it must be
                writable and must not be, lie inside or contain a folder this run reads
                (`input_folders()`: the base, experts, adapters, the merged model's folder, local
                datasets, the checkpoint folder). Everything is written into a temporary folder (inside
                an existing `output_dir`, so a mount point works) and renamed into place: a failure
                part-way leaves the previous folder (or none), never a partial one. The save records
                what it wrote in ``featcal_manifest.json``; saving again into the folder replaces exactly
                those files (no stale shard is left) and keeps every other file.
            processing_class: what to save beside the model (a tokenizer, image processor or
                processor, or a list of them); default: the calibrator's `processing_class`. open_clip's
                preprocessing is recorded in `open_clip_config.json` with the model. A model that reads
                text (a CLIPModel, T5, BERT, an LLM) is saved with a tokenizer: when none is given, the
                base's (else the merged model's folder's) is added; when none is found there either,
                `hf_featcal.processing.MissingTokenizerError` is raised before anything is written.
            overwrite: a non-empty `output_dir` that is not an earlier save of this library is refused
                (naming what it holds) unless True; then the files this save writes replace same-named
                ones there and every other file is kept.
        """
        from .saving import atomic_folder

        if not self._calibrated:
            raise RuntimeError("save_model() needs a calibrated model: call calibrate() first.")
        if not self.state.is_main_process:
            return
        card = self.create_model_card()  # before anything is written: an unreadable source fails here
        processing_class = self.processing_to_save(processing_class)  # a missing tokenizer fails here
        with atomic_folder(output_dir, inputs=self.input_folders(), overwrite=overwrite) as folder:
            self.write_model_folder(folder, processing_class=processing_class, card=card)

    def processing_to_save(self, processing_class: Any = None) -> Any:
        """What `save_model` writes beside the model: `processing_class` (default: the calibrator's),
        with the base's tokenizer (else the merged model's folder's) added when the model reads text and
        none is given (`hf_featcal.processing.with_tokenizer`; raises `MissingTokenizerError` when none
        is found)."""
        from .processing import with_tokenizer

        given = self.processing_class if processing_class is None else processing_class
        sources: list[tuple[str, str | None]] = []
        if self.base is not None:
            sources += [("the base", path) for path in _source_paths(self.base)]
            if self.base.name and self.base.name not in dict(sources).values():
                sources.append(("the base", self.base.name))
        merged_from = getattr(getattr(self.model, "config", None), "_name_or_path", None)
        if isinstance(merged_from, str) and merged_from:
            sources.append(("the merged model", merged_from))
        return with_tokenizer(self.model, given, sources)

    def write_model_folder(self, folder: str, *, processing_class: Any = None, card: Any = None) -> None:
        """Write what `save_model` saves (model, processing classes, FeatCal config, drift report, model
        card) into `folder` as it is: no other checks, not atomic. For code that adds files to the same
        save inside `hf_featcal.saving.atomic_folder` (the recipes' save stage)."""
        from .saving import save_model_files

        save_model_files(self.model, folder, layer_map=self.layer_map,
                         processing_class=self.processing_to_save(processing_class))
        self.config.save_pretrained(folder)
        if self._report is not None:
            self._report.save(folder)
        (self.create_model_card() if card is None else card).save(os.path.join(folder, "README.md"))

    def input_folders(self) -> dict[str, str]:
        """Argument → local folder (or file) of everything this run reads: the merged model's folder,
        the base, the experts (and LoRA adapters), local calibration datasets and `checkpoint_dir`.
        A save into, inside or around any of them is refused (`hf_featcal.saving.check_output_dir`)."""
        folders: dict[str, str] = {}
        merged_from = (getattr(getattr(self.model, "config", None), "_name_or_path", None)
                       or getattr(self.model, "name_or_path", None))
        if isinstance(merged_from, str) and os.path.isdir(merged_from):
            folders["model"] = merged_from
        sources = {**({"base_model": self.base} if self.base is not None else {}),
                   **{f"experts[{task!r}]": source for task, source in self.experts.items()}}
        for argument, source in sources.items():
            for index, path in enumerate(_source_paths(source)):
                folders[argument if not index else f"{argument} ({index})"] = path
        for task, data in self._calibration_data.items():
            for index, cache in enumerate(getattr(data, "cache_files", None) or []):
                if isinstance(cache, dict) and cache.get("filename"):
                    folders[f"calibration_data[{task!r}]" + (f" ({index})" if index else "")] = cache["filename"]
        if self.checkpoint_dir is not None:
            folders["checkpoint_dir"] = os.fspath(self.checkpoint_dir)
        return folders

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload FeatCal-calibrated merged model",
        processing_class: Any = None,
    ) -> Any:
        """Upload what `save_model` writes (saved into a fresh temporary folder; local paths redacted) to
        the hub in one commit, creating the repo (`private` as in `HfApi.create_repo`) if needed; weight
        files of an earlier upload that this one does not write, e.g. stale shards, are deleted in the
        same commit (`hf_featcal.saving.push_folder`)."""
        from .hub import check_push_target
        from .saving import push_folder

        if not self._calibrated:
            raise RuntimeError("push_to_hub() needs a calibrated model: call calibrate() first.")
        if not self.state.is_main_process:
            return None
        check_push_target(repo_id, private=private, token=token, argument="repo_id")  # before the model is saved
        with tempfile.TemporaryDirectory() as staging:
            folder = os.path.join(staging, "model")
            self.save_model(folder, processing_class=processing_class)
            return push_folder(folder, repo_id, private=private, token=token, commit_message=commit_message)

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

    # ================================================================== the block loop
    def _sweep(self) -> DriftReport | None:
        """Every block in forward order; a checkpointed run continues after its last finished block."""
        ctx = self.context
        stacks = self.layer_map.stacks(ctx.tower)
        total = sum(len(s.blocks) for s in stacks)
        drift = DriftLog.empty(self.tasks, self.heldout_batches is not None) if self.config.report_drift else None
        streams, done = Streams(), 0
        entered, early = self._take_entered(), self._take_entered_streams()
        checkpoint = None if self.checkpoint_dir is None else open_checkpoint(
            ctx, self.checkpoint_dir, self.tasks, self._data_digest, self._tower_parameter_names(), self.experts,
            self.base,
        )
        resumed = None if checkpoint is None else resume(ctx, checkpoint)
        if resumed is not None:
            assert checkpoint is not None  # only a checkpoint folder resumes
            done, streams, drift = resumed.finished_blocks, resumed.streams, resumed.drift
            ctx.logger.info("resuming from %s after block %d of %d", checkpoint.path, done, total)
        progress = tqdm(total=total, initial=done, desc="FeatCal", disable=not self.show_progress, unit="block")
        flat = 0  # blocks before the current one, over every stack
        try:
            for si, stack in enumerate(stacks):
                if done >= flat + len(stack.blocks):  # the whole stack was finished before
                    flat += len(stack.blocks)
                    continue
                if done <= flat:  # streams enter this stack (a resumed run may bring the previous stack's)
                    progress.set_postfix_str(f"entering {stack.name}")
                    with ctx.timed("entering stacks"):
                        if si == 0 and early is not None:  # entered while the calibrator was built
                            streams = early if drift is not None else Streams(
                                early.student, early.expert, None, early.heldout_student, early.heldout_expert)
                        else:
                            # (the last stack's entry releases the calibration batches: a calibrator runs once)
                            streams = enter_stack(
                                ctx, si, streams, self.batches, self.experts,
                                None if drift is None else self.drift_sample, entered if si == 0 else None,
                                release=si == len(stacks) - 1, heldout=self.heldout_batches,
                            )
                        entered = early = None  # `streams` holds them now: each block lets its entering batches go
                    if si == len(stacks) - 1:
                        self._batches_released = True
                for bi, block in enumerate(stack.blocks):
                    flat += 1
                    if flat <= done:
                        continue

                    def note(message: str, at: str = f"({flat}/{total})") -> None:
                        progress.set_postfix_str(f"{at} {message}")

                    final = flat == total  # the model's last block: its student stream feeds nothing but the report
                    streams = self._calibrate_block(self._plans[(si, bi)], block, streams, drift, note, final)
                    if checkpoint is not None:
                        note("checkpointing")
                        with ctx.timed("checkpointing"):
                            save_block(ctx, checkpoint, flat, self._block_parameter_names(si, bi), streams, drift)
                    progress.update(1)
        finally:
            progress.close()
        if drift is None:
            return None
        sample: dict[str, Any] = {
            "examples_per_task": dict(self.drift_sample.examples_per_task),
            "calibration_examples_per_task": dict(self.samples_per_task),
            "drift_samples_per_task": self.config.drift_samples_per_task, "seed": self.config.seed,
        }
        if self.heldout_per_task is not None:
            sample.update(heldout_examples_per_task=dict(self.heldout_per_task),
                          heldout_fraction=self.config.heldout_fraction)
        guard = None if self.config.guard == "none" else {"mode": self.config.guard, "blocks": list(ctx.guard_log)}
        return DriftReport(drift.tasks, sample=sample, guard=guard)

    def _calibrate_block(
        self, plan: BlockPlan, block: nn.Module, streams: Streams, drift: DriftLog | None, note: Callable[[str], None],
        final: bool = False,
    ) -> Streams:
        """One block: capture and accumulate, solve and write, propagate, drift; the streams leaving it.

        Block granularity solves the whole plan from one pass. Module granularity solves it in steps
        (`pipeline/steps.py`): the first pass gives the first step's statistics and the expert stream
        leaving the block; each later step gets a new, statistics-only pass through the partly written block.

        Each stream entering the block is dropped task by task as the same task's leaving batches are
        made (`capture_block`'s `release`, `propagate`), so `streams` is used up. After the `final`
        block (the model's last) only the drift report reads the streams: the student stream is
        propagated for the drift sample's batches alone, and the streams leaving it hold those batches
        only (none without the report).

        With held-out examples their streams pass the block beside these (the expert's in the capture
        pass); with a guard the block's solutions are then blended towards the merged block on them
        (`pipeline/guard.py`) before the calibration student stream is propagated."""
        ctx = self.context
        sample = self.drift_sample
        steps = [plan]
        if plan.calibrating and self.config.granularity == "module":
            with ctx.timed("module order"):
                steps = module_steps(plan, forward_order(ctx, plan, block, streams))
        # which merged-as-given batches are still the student's (until a block is calibrated), taken before
        # `propagate` moves the student stream on: a calibrated block's capture pass runs them to the
        # block's end and gives them; an unchanged block's leave it as the student's do
        shared = None if drift is None else shared_with_student(streams, sample)
        # a later step's statistics-only pass reads the entering expert stream again
        captured = capture_block(ctx, steps[0], block, streams, self.experts, _step_note(note, steps, 0),
                                 release=len(steps) == 1, heldout_expert=streams.heldout_expert,
                                 whole=None if shared is None else student_batches_as_given(shared, sample))
        given = heldout_given = None
        if drift is not None and plan.calibrating:  # through the block as given, before it is written
            assert streams.given is not None  # entered with the drift report
            with ctx.timed("drift (merged-as-given stream)"):
                given = advance_given(ctx, block, plan.block_index, streams.given, sample, shared,
                                      captured.student_as_given)
                if streams.heldout_given is not None:
                    heldout_given = advance_heldout_given(ctx, block, plan.block_index, streams.heldout_given)
        guarding = plan.calibrating and self.config.guard != "none"
        merged = merged_values(ctx, plan, block) if guarding else {}  # the guard's γ = 0
        solved: dict[str, set[str]] = {}  # module → the attributes its solutions wrote
        first_solve = len(ctx.solve_log)
        if plan.calibrating:
            statistics = captured.statistics
            for index, step in enumerate(steps):
                if index:  # the student's inputs of this step, through the steps written so far
                    statistics = capture_block(
                        ctx, step, block, streams, self.experts, _step_note(note, steps, index), leaving=False
                    ).statistics
                _step_note(note, steps, index)("solving")
                with ctx.timed("solving"):
                    for name, update in self._solve_and_write(step, block, statistics).items():
                        solved.setdefault(name, set()).update(update)
        heldout_student, heldout_given = self._heldout_leaving(plan, block, streams, captured.heldout_expert, merged,
                                                               solved, first_solve, heldout_given, note)
        note("propagating")
        assert streams.student is not None  # every stack is entered with a student stream
        entering, expert = streams.student, captured.expert
        if final:
            kept = {task: [] if drift is None else [b for b, _ in sample.rows[task]] for task in entering}
            entering = {task: [entering[task][b] for b in kept[task]] for task in kept}
            expert = {task: [expert[task][b] for b in kept[task]] for task in kept}
            sample = sample.positional(entering)  # the streams leaving hold the sample's batches, in order
        with ctx.timed("propagating"):
            student = propagate(ctx, block, plan, entering)
        if drift is not None and given is None:  # an unchanged block: the batches shared with the student stay shared
            assert streams.given is not None  # entered with the drift report
            with ctx.timed("drift (merged-as-given stream)"):
                given = advance_given(ctx, block, plan.block_index, streams.given, sample, shared, student)
        leaving = Streams(student, expert, given, heldout_student, captured.heldout_expert, heldout_given)
        if drift is not None:
            with ctx.timed("drift (merged-as-given stream)"):
                record_drift(ctx, drift, leaving, sample, plan.pooled_token_index)
                if leaving.heldout_given is not None:
                    record_heldout_drift(ctx, drift, leaving, plan.pooled_token_index)
        return leaving

    def _heldout_leaving(
        self, plan: BlockPlan, block: nn.Module, streams: Streams, heldout_expert: TaskStreams | None,
        merged: BlockUpdates, solved: dict[str, set[str]], first_solve: int, heldout_given: TaskStreams | None,
        note: Callable[[str], None],
    ) -> tuple[TaskStreams | None, TaskStreams | None]:
        """The held-out student and merged-as-given streams leaving a block whose solutions are written
        (None, None without held-out examples). With a guard and a calibrated block, the guard
        (`pipeline/guard.py`) blends the block first (`merged`: its values before the solve; `solved`:
        module → attributes written; the solve log's entries from `first_solve` on are this block's)
        and its chosen γ's held-out outputs leave; otherwise the held-out student stream is propagated
        and, through an unchanged block, the merged-as-given one with it (`heldout_given`: that stream
        leaving a calibrated block, run before its solutions were written)."""
        ctx = self.context
        if streams.heldout_student is None:
            return None, None
        if plan.calibrating and self.config.guard != "none":
            note("guard")
            assert heldout_expert is not None  # the capture pass ran the held-out expert stream
            with ctx.timed("guard"):
                entry, leaving = guard_block(ctx, plan, block, merged, solved, streams.heldout_student, heldout_expert)
            ctx.guard_log.append(entry)
            for logged in ctx.solve_log[first_solve:]:
                logged["guard_gamma"] = entry["gamma"]
            return leaving, heldout_given
        shared = None
        if streams.heldout_given is not None and heldout_given is None:  # an unchanged block
            shared = {task: [g is s for g, s in zip(states, streams.heldout_student[task], strict=True)]
                      for task, states in streams.heldout_given.items()}
        with ctx.timed("propagating"):
            leaving = propagate(ctx, block, plan, streams.heldout_student)
        if shared is not None:
            assert streams.heldout_given is not None  # entered with the drift report
            with ctx.timed("drift (merged-as-given stream)"):
                heldout_given = advance_heldout_given(ctx, block, plan.block_index, streams.heldout_given, shared,
                                                      leaving)
        return leaving, heldout_given

    def _solve_and_write(self, plan: BlockPlan, block: nn.Module, statistics: BlockStatistics) -> BlockUpdates:
        """Solve one block's (or step's) plan and write its solutions; returns them."""
        ctx = self.context
        base_block = None
        if self.base is not None:
            base_block = self.base.block(ctx.model, plan.stack_index, plan.block_index, ctx.device)
        updates = solve_block(ctx, plan, block, statistics, base_block)
        write_block(self.parameters, block, plan.specs, updates, ctx.where(plan.stack_index, plan.block_index))
        return updates

    # ================================================================== helpers
    def _take_in(self, task: str, entered: TaskStreams, samples: list[DriftSample], digest: DigestBuilder | None,
                 keep: Callable[[int], bool]) -> None:
        """One task's batches, read: checked through the merged model's input path (the student stream
        of the batches `keep` accepts goes into `entered`), hashed for a checkpoint, their drift sample
        drawn (from every process's batches), then shared out among the processes. Where the streams
        enter the first stack now (`_entered_streams`), the task's expert and drift streams enter it too
        and its batches are let go."""
        config, main_input = self.config, self.layer_map.main_input_name
        rank, world = self.state.process_index, self.state.num_processes
        batches = self.batches[task]
        entered.update(check_batches_enter_model(self.context, {task: batches}, keep=keep))
        heldout = self.heldout_batches
        if heldout is not None:  # the user's examples held out are checked as the others are (no stream kept)
            check_batches_enter_model(self.context, {task: heldout[task]}, keep=lambda index: False)
        if digest is not None:
            digest.add_all(_tensor_parts(task, batches))
            if heldout is not None:
                digest.add_all(_tensor_parts(f"heldout.{task}", heldout[task]))
        sample = DriftSample.choose({task: batches}, config.drift_samples_per_task, config.seed, main_input,
                                    rank, world)
        samples.append(sample)
        if heldout is not None:
            assert self.heldout_per_task is not None  # set up with `heldout_batches`
            self.heldout_per_task[task] = sum(batch_size_of(b, main_input) for b in heldout[task])
        if world > 1:
            self.batches[task] = batches = batches[rank::world]
            if heldout is not None:
                heldout[task] = heldout[task][rank::world]
        self.batch_sizes[task] = [batch_size_of(b, main_input) for b in batches]
        if self._entered_streams is not None:
            ctx = self.context
            with eval_mode(self.model, *self._reference_models()), torch.no_grad(), ctx.timed("entering stacks"):
                streams = enter_stack(ctx, 0, Streams(), self.batches, {task: self.experts[task]}, sample,
                                      student={task: entered.pop(task)}, release=True, heldout=heldout)
            self._entered_streams.add(streams)

    def _check_config_unchanged(self) -> None:
        """The config may be edited between construction and `calibrate()`: check it again, refuse a
        change of what shaped the batches, and plan the blocks again for the rest."""
        self.config.validate()
        now = self.config.to_dict()
        if now == self._planned_config:
            return
        for name in ("num_samples_per_task", "batch_size", "seed", "drift_samples_per_task", "heldout_fraction"):
            if now[name] != self._planned_config[name]:
                raise ValueError(
                    f"FeatCalConfig.{name} changed after the calibrator was built ({self._planned_config[name]!r} → "
                    f"{now[name]!r}); it shapes the calibration batches: build a new FeatCalCalibrator."
                )
        self.context.compute_dtype = getattr(torch, self.config.compute_dtype)
        self.context.task_weights = self.config.normalised_task_weights(self.tasks)
        self._plans = plan_blocks(self.layer_map, select_modules(self.layer_map, self.context.tower, self.config))
        self._planned_config = copy.deepcopy(now)

    def _take_entered(self) -> TaskStreams | None:
        """The first stack's student stream from the construction's check, once; None where the tower's
        inputs now go to another device (the model was moved since) or it was taken already."""
        if self._entered is None:
            return None
        device, entered = self._entered
        self._entered = None
        return entered if self.context.input_device(self.context.tower) == device else None

    def _take_entered_streams(self) -> Streams | None:
        """The streams that entered the first stack while the calibrator was built, once (moved where
        streams wait now, should the model have been moved since); None where there are none."""
        streams, self._entered_streams = self._entered_streams, None
        if streams is None or self.context.input_device(self.context.tower) == self._entered_device:
            return streams
        moved: dict[int, StreamBatch] = {}  # a drift batch that is the student's stays the same object

        def move(batch: StreamBatch) -> StreamBatch:
            if id(batch) not in moved:
                moved[id(batch)] = self.context.park(batch)
            return moved[id(batch)]

        return Streams(*(None if task_streams is None else {t: [move(b) for b in bs] for t, bs in task_streams.items()}
                         for task_streams in (streams.student, streams.expert, streams.given, streams.heldout_student,
                                              streams.heldout_expert, streams.heldout_given)))

    def _reference_models(self) -> list[nn.Module]:
        sources = [*self.experts.values(), *([self.base] if self.base is not None else [])]
        return [model for source in sources for model in source.modules_for_eval()]

    def _parameter_names(self) -> list[str]:
        """Qualified names of every parameter FeatCal may write."""
        return [name for si, bi in self._plans for name in self._block_parameter_names(si, bi)]

    def _tower_parameter_names(self) -> list[str]:
        tower_params = {id(p) for p in self.context.tower.parameters()}
        return [name for name, p in self.model.named_parameters() if id(p) in tower_params]

    def _block_parameter_names(self, si: int, bi: int) -> list[str]:
        return block_parameter_names(self._plans[(si, bi)], self.context.block(si, bi), self.parameters)


# ====================================================================== helpers
def _tensor_parts(prefix: str, batches: list[Batch]) -> Iterator[tuple[str, Tensor]]:
    """The batches' tensors named for a digest (`prefix.<batch>.<key>`, keys in order)."""
    return ((f"{prefix}.{i}.{key}", value) for i, batch in enumerate(batches)
            for key, value in sorted(batch.items()) if isinstance(value, Tensor))


def _step_note(note: Callable[[str], None], steps: list[BlockPlan], index: int) -> Callable[[str], None]:
    """Progress messages of one step (prefixed with the step when a block is solved in several)."""
    if len(steps) == 1:
        return note
    prefix = f"step {index + 1}/{len(steps)} ({steps[index].capture_sources[0]})"
    return lambda message: note(f"{prefix} {message}")


def _source_paths(source: ModelSource) -> list[str]:
    """The local folders (or files) a model source reads: a checkpoint's folder or files, a LoRA
    adapter's folder and its base's, an in-memory model's folder when it was loaded from one."""
    adapter = getattr(source, "adapter", None)
    if adapter is not None:
        base = getattr(source, "base", None)
        return [adapter.folder, *(_source_paths(base) if base is not None else [])]
    folder = getattr(source, "folder", None)
    if folder:
        return [folder]
    files = getattr(getattr(source, "_tensors", None), "files", None)  # a library checkpoint's safetensors files
    if isinstance(files, Mapping) and files:
        return sorted({os.path.dirname(path) for path in files.values()})
    name = getattr(source, "name", None)
    return [name] if isinstance(name, str) and os.path.isdir(name) else []


def default_process_state() -> PartialState:
    """The process state of a run given no `Accelerator`: accelerate's, from the launcher's environment
    (one process without a launcher)."""
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


def _warn_rising_tasks(report: DriftReport) -> None:
    """A `FeatCalWarning` for the tasks whose head measure at the last block rose with calibration: one
    for the calibration examples (`rising_tasks`), one for the held-out ones (`heldout_rising_tasks`,
    where a held-out share exists). A rise on held-out examples alone is an in-sample gain that does not
    carry over."""
    for tasks, measure, where, advice in (
        (report.rising_tasks(), "head", "", "while calibration served all tasks jointly: check their accuracy; "
         "a larger lambda_ratio, or tune_featcal on held-out data, softens the compromise (docs/tuning.md)."),
        (report.heldout_rising_tasks(), "heldout_head", "on the held-out examples ",
         "(examples the calibration did not see: a gain on the calibration examples that does not carry over "
         "is over-fitting): check their accuracy; the held-out guard (guard='no_rise'), a larger lambda_ratio "
         "or more calibration examples keep a task from being hurt (docs/tuning.md)."),
    ):
        if not tasks:
            continue
        before, after = f"{measure}_before", f"{measure}_after"
        moves = ", ".join(f"{t}: {report.tasks[t][before][-1]:.2%} → {report.tasks[t][after][-1]:.2%}" for t in tasks)
        warnings.warn(
            f"{where}what the head reads moved away from the expert for task(s) {tasks} (relative drift at the "
            f"last block {moves}) {advice}",
            FeatCalWarning,
            stacklevel=3,
        )
