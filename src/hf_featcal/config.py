"""`FeatCalConfig`: every setting of a FeatCal run, in the style of PEFT's configs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CONFIG_NAME = "featcal_config.json"
#: `FeatCalConfig.forward_dtype` values besides None (fast mode)
FORWARD_DTYPES = ("bfloat16", "float16")
#: where `FeatCalConfig.restore_snapshot` may keep the restore copy
RESTORE_SNAPSHOTS = ("memory", "disk")
#: `FeatCalConfig.guard` values: no guard, or how the held-out guard picks each block's blend γ
GUARD_MODES = ("none", "no_rise", "minimax")
#: `FeatCalConfig.guard_gammas`' default: the blends W_merged + γ·(W_calibrated − W_merged) the guard tries
DEFAULT_GUARD_GAMMAS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: fields whose check needs other fields' values (a field checked on its own takes these along)
CHECKED_WITH = {"guard": ("heldout_fraction",)}


@dataclass
class FeatCalConfig:
    """Settings of a FeatCal calibration.

    Defaults follow the authors' released demo (the published reference numbers); the paper text's
    values are noted in each field's help. Validated on construction and on every later assignment
    (an invalid value is refused and the old one kept); saved and loaded as JSON with
    `save_pretrained` / `from_pretrained`.
    """

    lambda_ratio: float = field(
        default=0.05,
        metadata={"help": "Ridge strength λ pulling every solved parameter towards the anchor (≥ 0)."},
    )
    anchor_rho: float = field(
        default=2.2,
        metadata={
            "help": "Anchor A = base + ρ·(merged − base). 1 anchors at the merged weights. "
            "Demo 2.2, paper text 2.0. Without a base model the anchor is the merged weights."
        },
    )
    teacher_alpha: float = field(
        default=0.25,
        metadata={
            "help": "Teacher input x_t = α·x_expert + (1−α)·x_student, in [0, 1]. Demo 0.25, paper text 0.3."
        },
    )
    final_block_token_weight: float = field(
        default=0.01,
        metadata={
            "help": "For pooled-head models (CLIP vision), weight of the non-pooled tokens in the last block "
            "for every module except key/value projections, in [0, 1]."
        },
    )
    epsilon: float = field(
        default=1e-8,
        metadata={"help": "Floor on norms and determinants, and added to the Gram diagonal (> 0)."},
    )
    num_samples_per_task: int | None = field(
        default=256,
        metadata={"help": "Calibration examples used per task (None: all that are given)."},
    )
    max_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest text in tokens when `processing_class` tokenises a `datasets.Dataset` text column: "
            "longer texts are truncated. None: the model's maximum (the smaller of the model config's "
            "max_position_embeddings and the tokenizer's model_max_length, where known; no truncation when "
            "neither is). Batches given as tensors are used as given."
        },
    )
    batch_size: int = field(
        default=16,
        metadata={"help": "Batch size when calibration data is a `datasets.Dataset` (iterables are used as given)."},
    )
    calibrate_bias: bool = field(default=True, metadata={"help": "Solve Linear biases (else keep the merged ones)."})
    calibrate_norms: bool = field(
        default=True, metadata={"help": "Solve normalisation layers' affine parameters (else keep the merged ones)."}
    )
    task_weights: dict[str, float] | None = field(
        default=None,
        metadata={
            "help": "Task → weight of that task's terms in the joint objective of every Linear and norm (the task's "
            "statistics are multiplied by it), e.g. {'language': 2.0} when calibration hurts that task: up-weight it. "
            "Each weight is finite and ≥ 0 (0 drops the task's terms; its data still flows), a task not named weighs "
            "1, and the weights are rescaled to mean 1 over the experts' tasks (ω_i = w_i·T / Σ_j w_j), so the data "
            "terms keep their total weight T and λ its meaning. None (or all weights equal): the paper's method."
        },
    )
    seed: int = field(
        default=42,
        metadata={"help": "Seed for shuffling `datasets.Dataset` calibration data (≥ 0, as `Dataset.shuffle` takes)."},
    )
    target_modules: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Modules to calibrate, named relative to a block (e.g. 'mlp.fc2'). A list matches exact "
            "names or name suffixes after a '.', a string is a regex that must match the whole name "
            "(as in PEFT). None: every Linear and norm of every block."
        },
    )
    exclude_modules: list[str] | str | None = field(
        default=None,
        metadata={"help": "Modules to leave at their merged values; same matching rules as `target_modules`."},
    )
    layers_to_transform: list[int] | int | None = field(
        default=None,
        metadata={
            "help": "Indices of the blocks to calibrate (an int or a list; negative indices count from the end). "
            "None: every block. Other blocks keep their merged values but still carry the feature streams."
        },
    )
    report_drift: bool = field(
        default=True,
        metadata={
            "help": "Measure the per-block feature drift before and after calibration (one extra merged forward per "
                    "block on the examples `drift_samples_per_task` chooses)."
        },
    )
    drift_samples_per_task: int | None = field(
        default=32,
        metadata={
            "help": "Calibration examples per task the drift report measures (None: all of them). A diagnostic "
            "needs few: the merged-as-given stream runs on these examples only, chosen the same way every run "
            "(whole batches in an order drawn with `seed`, the last one cut to its first examples). Does not change "
            "the calibrated weights."
        },
    )
    stream_placement: str = field(
        default="accelerator",
        metadata={
            "help": "Where the per-task feature streams wait between blocks: 'accelerator' (the compute device; "
            "fastest), 'cpu' (frees accelerator memory) or 'pinned_cpu' (CPU, page-locked for fast copies). "
            "Does not change results."
        },
    )
    compute_dtype: str = field(
        default="float32",
        metadata={"help": "dtype of the accumulated statistics and of the solves: 'float32' or 'float64'."},
    )
    forward_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Fast mode (off by default). None: block forwards in the model's own dtype (exact). "
            "'bfloat16' or 'float16': block forwards under torch.autocast in that dtype (AMX on CPU, tensor "
            "cores on GPU) and, where that is faster, the statistics' products take factors in that dtype with "
            "float32 outputs (CUDA's `out_dtype`; on AMX CPUs the mixed-precision GEMM of the MKL inside torch) or, "
            "on CPUs with AVX-512 BF16 but no AMX (e.g. AMD Zen 4), as torch's bf16 product rounded once per batch; "
            "statistics are still accumulated and solved in `compute_dtype`. Changes results slightly."
        },
    )
    restore_snapshot: str = field(
        default="memory",
        metadata={
            "help": "Where the copy of the merged model kept to restore it if calibration fails is held: "
            "'memory' (host RAM; fastest) or 'disk' (safetensors files in a temporary folder, memory-mapped "
            "as they are written so a temp-folder cleaner cannot take them, read only to restore and removed "
            "at the end; for models larger than host RAM). "
            "Does not change results."
        },
    )
    reuse_freed_cpu_memory: bool = field(
        default=False,
        metadata={
            "help": "Opt-in, CPU runs on Linux (glibc): during calibrate() freed memory is kept for reuse instead of "
            "being handed back to the system and page-faulted in again (2-3x fewer page faults on the CLIP benchmark; "
            "its time and peak RSS moved within the machine's noise). Afterwards glibc keeps blocks of up to 32 MB "
            "(the ceiling its own adaptive threshold reaches) and free memory is handed back. Does not change results."
        },
    )
    granularity: str = field(
        default="block",
        metadata={
            "help": "'block' (the paper's method): every module of a block is solved from one pass over the "
            "uncalibrated block. 'module': the block's modules are solved one step at a time in forward order "
            "(modules reading one input, e.g. q/k/v, together), the student's inputs of later modules captured "
            "again after each step, so a norm and the Linear after it do not compensate for the same mismatch; "
            "costs one more pass over the calibration data per step."
        },
    )

    heldout_fraction: float = field(
        default=0.0,
        metadata={
            "help": "Share of each task's calibration examples held out, in [0, 1): round(share × examples), at least "
            "one, taken as whole batches in an order drawn with `seed`, the last one cut (its first examples held "
            "out, the rest kept), before the batches are shared out between processes (so the split does not "
            "depend on their number); at least one example must be left to calibrate on. Held-out examples are not "
            "used for the statistics (the calibration sees fewer examples); their student and expert streams flow "
            "beside the calibration streams, for the `guard` and for the drift report's held-out columns. 0: none "
            "(the paper's method)."
        },
    )
    guard: str = field(
        default="none",
        metadata={
            "help": "Held-out guard (needs `heldout_fraction` > 0): after each block is solved, its Linears and norms "
            "(weights and biases) are set to W_merged + γ·(W_calibrated − W_merged) for each γ of `guard_gammas`, "
            "and γ is chosen on the held-out examples' head-weighted relative drift from the experts: 'no_rise' "
            "(the largest γ at which no task's drift is above its γ = 0 value), 'minimax' (the γ minimising the "
            "largest ratio of a task's drift to its γ = 0 value; ties: the larger γ) or 'none' (no guard, γ = 1)."
        },
    )
    guard_gammas: list[float] = field(
        default_factory=lambda: list(DEFAULT_GUARD_GAMMAS),
        metadata={
            "help": "The blends the guard tries: increasing values in [0, 1], starting at 0 (the merged block, the "
            "reference of both guards). γ = 1 is the unguarded calibration, bit for bit."
        },
    )

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()
        object.__setattr__(self, "_validated", True)

    def __setattr__(self, name: str, value: Any) -> None:
        # after construction, an assignment is validated like the constructor's arguments
        if not self.__dict__.get("_validated") or name not in self.__dataclass_fields__:
            object.__setattr__(self, name, value)
            return
        old = self.__dict__[name]
        object.__setattr__(self, name, value)
        try:
            self._normalise()
            self._validate()
        except BaseException:
            object.__setattr__(self, name, old)
            raise

    def _normalise(self) -> None:
        for name in ("target_modules", "exclude_modules", "layers_to_transform", "guard_gammas"):
            value = self.__dict__[name]
            ranged = name in ("layers_to_transform", "guard_gammas") and isinstance(value, range)
            if isinstance(value, tuple) or ranged:
                object.__setattr__(self, name, list(value))
        weights = self.__dict__["task_weights"]
        if isinstance(weights, Mapping) and all(_is_real(w) for w in weights.values()):
            # a copy with float values: 2 and 2.0 are one setting (one JSON text, one checkpoint fingerprint)
            object.__setattr__(self, "task_weights", {task: float(w) for task, w in weights.items()})

    def validate(self) -> None:
        """Check every field again (raises ValueError naming the field), e.g. after a list was edited in place."""
        self._validate()

    def _validate(self) -> None:  # noqa: C901 - one flat check per field, in field order
        def real(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"FeatCalConfig.{name} must be a finite real number, got {value!r}.")
            return float(value)

        if real("lambda_ratio") < 0:
            raise ValueError(f"FeatCalConfig.lambda_ratio must be ≥ 0, got {self.lambda_ratio!r}.")
        real("anchor_rho")
        for name in ("teacher_alpha", "final_block_token_weight"):
            if not 0.0 <= real(name) <= 1.0:
                raise ValueError(f"FeatCalConfig.{name} must be in [0, 1], got {getattr(self, name)!r}.")
        if real("epsilon") <= 0:
            raise ValueError(f"FeatCalConfig.epsilon must be > 0, got {self.epsilon!r}.")
        for name in ("num_samples_per_task", "drift_samples_per_task"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"FeatCalConfig.{name} must be a positive integer or None, got {value!r}.")
        if self.max_length is not None and (
            isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 1
        ):
            raise ValueError(f"FeatCalConfig.max_length must be a positive integer or None, got {self.max_length!r}.")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"FeatCalConfig.batch_size must be a positive integer, got {self.batch_size!r}.")
        for name in ("calibrate_bias", "calibrate_norms", "report_drift", "reuse_freed_cpu_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FeatCalConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        self._validate_task_weights()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            # `Dataset.shuffle` refuses a negative seed, but only once it shuffles
            raise ValueError(f"FeatCalConfig.seed must be a non-negative integer, got {self.seed!r}.")
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    re.compile(value)
                except re.error as err:
                    raise ValueError(f"FeatCalConfig.{name} is not a valid regular expression: {err}.") from None
            elif not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
                raise ValueError(
                    f"FeatCalConfig.{name} must be None, a regex string or a non-empty list of module names, got "
                    f"{value!r}."
                )
        layers = self.layers_to_transform
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
            object.__setattr__(self, "layers_to_transform", layers)
        if layers is not None and not (
            isinstance(layers, list)
            and layers
            and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        ):
            raise ValueError(
                f"FeatCalConfig.layers_to_transform must be None, an int or a non-empty list of ints, got {layers!r}."
            )
        if self.stream_placement not in ("accelerator", "cpu", "pinned_cpu"):
            raise ValueError(
                f"FeatCalConfig.stream_placement must be 'accelerator', 'cpu' or 'pinned_cpu', got "
                f"{self.stream_placement!r}."
            )
        if self.compute_dtype not in ("float32", "float64"):
            raise ValueError(f"FeatCalConfig.compute_dtype must be 'float32' or 'float64', got {self.compute_dtype!r}.")
        if self.forward_dtype is not None and self.forward_dtype not in FORWARD_DTYPES:
            raise ValueError(
                f"FeatCalConfig.forward_dtype must be None, 'bfloat16' or 'float16', got {self.forward_dtype!r}."
            )
        if self.restore_snapshot not in RESTORE_SNAPSHOTS:
            raise ValueError(
                f"FeatCalConfig.restore_snapshot must be 'memory' or 'disk', got {self.restore_snapshot!r}."
            )
        if self.granularity not in ("block", "module"):
            raise ValueError(f"FeatCalConfig.granularity must be 'block' or 'module', got {self.granularity!r}.")
        if not 0.0 <= real("heldout_fraction") < 1.0:
            raise ValueError(f"FeatCalConfig.heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}.")
        if self.guard not in GUARD_MODES:
            raise ValueError(f"FeatCalConfig.guard must be one of {list(GUARD_MODES)}, got {self.guard!r}.")
        if self.guard != "none" and self.heldout_fraction == 0:
            raise ValueError(
                f"FeatCalConfig.guard={self.guard!r} needs held-out examples: set heldout_fraction > 0 (e.g. 0.25) "
                "first, or guard='none'."
            )
        gammas = self.guard_gammas
        if not (
            isinstance(gammas, list) and gammas
            and all(not isinstance(g, bool) and isinstance(g, (int, float)) and 0.0 <= g <= 1.0 for g in gammas)
            and gammas[0] == 0 and all(a < b for a, b in zip(gammas, gammas[1:], strict=False))
        ):
            raise ValueError(
                "FeatCalConfig.guard_gammas must be a list of increasing numbers in [0, 1] starting at 0 (the merged "
                f"block, the guards' reference), e.g. {list(DEFAULT_GUARD_GAMMAS)}; got {gammas!r}."
            )

    def _validate_task_weights(self) -> None:
        weights = self.task_weights
        if weights is None:
            return
        if not isinstance(weights, dict) or not all(isinstance(task, str) and task for task in weights):
            raise ValueError(
                f"FeatCalConfig.task_weights must be None or a mapping task name → weight, got {weights!r}."
            )
        for task, weight in weights.items():
            if not _is_real(weight) or not math.isfinite(weight) or weight < 0:
                raise ValueError(
                    f"FeatCalConfig.task_weights[{task!r}] must be a finite real number ≥ 0, got {weight!r}."
                )

    def normalised_task_weights(self, tasks: Sequence[str]) -> dict[str, float]:
        """Each task's weight ω_i in the joint objective: `task_weights` (1 for a task not named) rescaled
        to mean 1 over `tasks`, ω_i = w_i·T / Σ_j w_j. Every weight is exactly 1.0 when `task_weights` is
        None or gives every task one value. Raises ValueError naming the field for a task not in `tasks`
        or weights that are all 0."""
        given = self.task_weights or {}
        unknown = sorted(set(given) - set(tasks))
        if unknown:
            raise ValueError(
                f"FeatCalConfig.task_weights names {unknown}, which are not tasks of this run; tasks: {list(tasks)}."
            )
        raw = {task: given.get(task, 1.0) for task in tasks}
        total = math.fsum(raw.values())
        if total <= 0:
            raise ValueError(
                f"FeatCalConfig.task_weights gives every task weight 0 ({given}): at least one task must weigh > 0."
            )
        return {task: weight * len(raw) / total for task, weight in raw.items()}

    # ------------------------------------------------------------------ selection
    def module_selected(self, name: str, *aliases: str) -> bool:
        """Whether the block-relative module `name` passes `target_modules` / `exclude_modules`; a
        pattern matching one of its `aliases` (a packed projection's name) counts as matching it."""
        names = (name, *aliases)
        if self.target_modules is not None and not any(matches_module_pattern(self.target_modules, n) for n in names):
            return False
        return not (
            self.exclude_modules is not None and any(matches_module_pattern(self.exclude_modules, n) for n in names)
        )

    def block_selected(self, index: int, num_blocks: int) -> bool:
        """Whether block `index` (of `num_blocks`) is calibrated."""
        layers = self.layers_to_transform
        if layers is None:
            return True
        assert not isinstance(layers, int)  # `_validate` turned a single int into a list
        return any(i % num_blocks == index for i in layers if -num_blocks <= i < num_blocks)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Write the config as `featcal_config.json` into `save_directory`; returns the file path."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2, sort_keys=True)
            handle.write("\n")
        return path

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> FeatCalConfig:
        """Load a config from a folder holding `featcal_config.json`, or from that file itself."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_NAME)
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no FeatCal config there (expected {CONFIG_NAME}).") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a valid JSON FeatCal config: {err}.") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a FeatCal config must be a JSON object of fields, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown FeatCalConfig fields {unknown}.")
        return cls(**data)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def matches_module_pattern(patterns: list[str] | str, name: str) -> bool:
    """PEFT's rule: a string is a regex matching the whole name; a list matches a name or a '.'-suffix."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)
