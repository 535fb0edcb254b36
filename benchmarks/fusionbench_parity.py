"""Side by side with FusionBench 0.2.33: each merge method of `hf_featcal.merging` (and the SVC post-step)
against FusionBench's implementation of it, on identical inputs.

Inputs, built here and seeded: a tiny `CLIPVisionModel` (hidden 16, 2 layers, 8×8 images, LayerNorms
randomised) and a tiny `LlamaForCausalLM` (hidden 32, 2 layers, untied head, RMSNorms randomised), each with
3 experts that differ from the base in every tensor (Gaussian noise of std 0.05 on every parameter); for
the methods that need data, calibration batches per task, with a different number of examples per task
(so that RegMean's Gram rule, summed per task or averaged per token, matters).

Per method and model: ours is `hf_featcal.merging.merge_models(base, experts, name, **params)` (for SVC
`hf_featcal.merging.svc.singular_value_calibration` on a Task Arithmetic merge), FusionBench's is its
algorithm class's `run` on a `BaseModelPool` of in-memory `nn.Module`s (deep copies: FusionBench writes
into the models it is given), on the CPU. FusionBench's RegMean / RegMean++ read their data through CLIP
zero-shot heads; here a subclass replaces only that (`on_regmean_start` no head, `compute_logits` the
plain forward) and the pool hands each task its batches as a dataset: FusionBench's own hooks take the
Grams, its own code solves and assembles the model. Each row says what it called.

Numbers, over every floating tensor of the two merged models' state dicts: max abs = the largest
|ours − FusionBench| entry; max rel = per tensor max|ours − FB| / max|FB − base| (relative to the largest
change the merge makes to that tensor; max|FB| where it makes none), the largest over the tensors.
Verdict: "bit-exact" (max abs 0); "float32 rounding (max rel X)" (X ≤ 1e-4: both compute in float32, or
one in float64, with other orders of operations); "differs by design: <reason>" (tensors a row names as
differing by design are left out of its numbers, which cover all the others); "FusionBench fails:
<error>"; "not in this build" (a method or parameter this checkout does not have yet); "DIFFERS ...
unexplained" is a finding to look into.

FusionBench is not a dependency of hf_featcal: the script runs itself inside a virtual environment of
its own (created when absent: `torch==2.13.0`, the lean CPU build, then `fusion-bench==0.2.33` and this
repository, editable), with this checkout's `src/` first on `PYTHONPATH` so that the code measured is this
checkout's whatever the venv has installed. Run from anywhere, with any Python >= 3.11:

    python benchmarks/fusionbench_parity.py                             # venv benchmarks/.fusionbench-venv
    python benchmarks/fusionbench_parity.py --venv /path/to/venv        # or FUSIONBENCH_PARITY_VENV=...
    python benchmarks/fusionbench_parity.py --methods ties,regmean --models clip
    python benchmarks/fusionbench_parity.py --no-venv                   # this interpreter has FusionBench

It prints a markdown table and writes the rows as JSON to `outputs/fusionbench_parity.json` (`--output`).
About 1.5 minutes on 2 CPU cores once the venv exists (creating it downloads about 1 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import logging
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parent.parent
DEFAULT_VENV = REPO / "benchmarks" / ".fusionbench-venv"
DEFAULT_OUTPUT = REPO / "outputs" / "fusionbench_parity.json"
VENV_ENV = "FUSIONBENCH_PARITY_VENV"
INNER_ENV = "FUSIONBENCH_PARITY_INNER"  # set on the re-run inside the venv
FUSIONBENCH_VERSION = "0.2.33"
TORCH_SPEC = "torch==2.13.0"  # the lean CPU build (scripts/setup.sh --without-open-clip)

#: The largest relative difference still called float32 rounding: float32 carries ~6e-8 relative; sums,
#: products and solves in another order (or one side in float64) move results by a few hundred ulps on
#: these inputs, while a wrong formula (another trim count, a missing term) moves them by 1e-3 or more.
FLOAT32_RTOL = 1e-4
NOISE_STD = 0.05  # the experts' difference from the base
SEED = 0


# ------------------------------------------------------------------------------------------ venv
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=None,
                        help=f"the venv with FusionBench (default ${VENV_ENV}, else {DEFAULT_VENV.relative_to(REPO)})")
    parser.add_argument("--no-venv", action="store_true", help="run in this interpreter (FusionBench installed here)")
    parser.add_argument("--torch", default=TORCH_SPEC, help=f"the torch to install in a new venv ({TORCH_SPEC})")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where the JSON goes")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the rows' methods (default all)")
    parser.add_argument("--models", default="clip,llama", help="comma-separated subset of clip,llama")
    parser.add_argument("--wudi-steps", type=int, default=20, help="WUDI's optimiser steps, both sides (20)")
    return parser.parse_args(argv)


def ensure_venv(venv: Path, torch_spec: str) -> Path:
    """The venv's interpreter; the venv created and filled first when it lacks what the run needs."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = ("import importlib.metadata as m, torch, transformers, hf_featcal; "
             f"assert m.version('fusion-bench') == {FUSIONBENCH_VERSION!r}")
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode != 0:
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        print(f"installing {torch_spec}, fusion-bench=={FUSIONBENCH_VERSION} and hf_featcal into {venv}", flush=True)
        subprocess.run([*pip, torch_spec], check=True)  # first, so that nothing pulls another torch build
        subprocess.run([*pip, f"fusion-bench=={FUSIONBENCH_VERSION}"], check=True)
        subprocess.run([*pip, "-e", str(REPO)], check=True)
    return python


def rerun_inside(python: Path, argv: list[str]) -> None:
    env = dict(os.environ)
    env[INNER_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    os.execve(str(python), [str(python), str(SCRIPT), *argv], env)


# ------------------------------------------------------------------------------------------ inputs
@dataclass
class Setting:
    """One model family's inputs: the base, 3 experts, calibration batches per task."""

    name: str
    base: Any
    experts: dict[str, Any]
    batches: dict[str, list[dict[str, Any]]]
    input_name: str
    description: str


def _perturbed(model: Any, generator: Any) -> Any:
    import torch

    expert = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in expert.parameters():
            parameter.add_(NOISE_STD * torch.randn(parameter.shape, generator=generator))
    return expert.eval()


#: examples per calibration batch, per task: 8, 6 and 9 examples (different token counts per task)
BATCH_SIZES = {"task0": [4, 4], "task1": [6], "task2": [3, 3, 3]}


def clip_setting() -> Setting:
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    config = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4, num_channels=3)
    base = CLIPVisionModel(config).eval()
    with torch.no_grad():  # γ=1, β=0 at init would give the Linears after a LayerNorm singular Grams
        for module in base.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=generator))
                module.bias.add_(0.2 * torch.randn(module.bias.shape, generator=generator))
    experts = {task: _perturbed(base, generator) for task in BATCH_SIZES}
    batches = {task: [{"pixel_values": torch.randn(n, 3, 8, 8, generator=generator)} for n in sizes]
               for task, sizes in BATCH_SIZES.items()}
    return Setting("clip", base, experts, batches, "pixel_values",
                   "CLIPVisionModel (hidden 16, 2 layers), 3 experts, 8/6/9 images")


def llama_setting() -> Setting:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED + 1)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    base = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: make them differ per channel
        for name, parameter in base.named_parameters():
            if "norm" in name:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    experts = {task: _perturbed(base, generator) for task in BATCH_SIZES}
    length = 8  # no padding: FusionBench's Grams count every token
    batches = {
        task: [{"input_ids": torch.randint(0, config.vocab_size, (n, length), generator=generator),
                "attention_mask": torch.ones(n, length, dtype=torch.long)} for n in sizes]
        for task, sizes in BATCH_SIZES.items()
    }
    return Setting("llama", base, experts, batches, "input_ids",
                   "LlamaForCausalLM (hidden 32, 2 layers, untied head), 3 experts, 8/6/9 sequences of 8 tokens")


def check_inputs(setting: Setting) -> None:
    """Every expert differs from the base in every floating tensor (else a method could pass by doing nothing)."""
    import torch

    base = setting.base.state_dict()
    for task, expert in setting.experts.items():
        for key, value in expert.state_dict().items():
            if value.is_floating_point() and torch.equal(value, base[key]):
                raise AssertionError(f"expert {task} equals the base on {key}")


# ------------------------------------------------------------------------------------------ FusionBench side
@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """FusionBench prints every key it merges and shows progress bars: kept out of the table."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def cpu_fabric() -> Any:
    import lightning

    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    return fabric


def fb_pool(setting: Setting, extra: dict[str, Any] | None = None, wrap: Callable[[Any], Any] | None = None) -> Any:
    """A `BaseModelPool` of deep copies (FusionBench merges into its pretrained model in place), each passed
    through `wrap` if given, whose `load_train_dataset(task)` gives the task's examples as (input, label) pairs."""
    from fusion_bench.modelpool import BaseModelPool

    examples = {task: [(row, 0) for batch in batches for row in batch[setting.input_name]]
                for task, batches in setting.batches.items()}

    class InMemoryPool(BaseModelPool):
        def load_train_dataset(self, dataset_name: str, *args: Any, **kwargs: Any) -> Any:
            return examples[dataset_name]

    models = {"_pretrained_": setting.base, **(extra or {}), **setting.experts}
    return InMemoryPool({name: (wrap or (lambda m: m))(copy.deepcopy(model)) for name, model in models.items()})


def _fb_class(path: str) -> type:
    """The class at `fusion_bench.method.<path>`."""
    module, _, name = f"fusion_bench.method.{path}".rpartition(".")
    return getattr(importlib.import_module(module), name)


def fb_run(algorithm: Any, setting: Setting, extra: dict[str, Any] | None = None,
           wrap: Callable[[Any], Any] | None = None) -> Any:
    import torch

    if hasattr(algorithm, "_fabric_instance"):
        algorithm.fabric = cpu_fabric()
    torch.manual_seed(SEED)  # FusionBench's data loaders shuffle
    with quiet():
        return algorithm.run(fb_pool(setting, extra, wrap))


def _forward_only(base: type) -> type:
    """FusionBench's CLIP RegMean class with the zero-shot classification head replaced by the model's plain
    forward on the batch's inputs: its hooks, Gram averaging, solve and assembly are FusionBench's."""

    class ForwardOnly(base):  # type: ignore[misc, valid-type]
        input_name = "pixel_values"

        @property
        def clip_processor(self) -> None:  # the pool's examples are tensors already
            return None

        def on_regmean_start(self) -> None:  # no CLIP text tower / zero-shot head here
            pass

        def compute_logits(self, module: Any, batch: Any, task: str) -> Any:
            inputs, _ = batch
            return module(**{self.input_name: inputs})

    ForwardOnly.__name__ = ForwardOnly.__qualname__ = f"{base.__name__}[forward only]"
    return ForwardOnly


def fb_regmean(setting: Setting, reduction: float) -> Any:
    from fusion_bench.method.regmean.clip_regmean import RegMeanAlgorithmForCLIP

    algorithm = _forward_only(RegMeanAlgorithmForCLIP)(
        dataloader_kwargs={"batch_size": 4, "num_workers": 0}, num_regmean_examples=10**9,
        exclude_param_names_regex=[], reduce_non_diagonal_ratio=reduction, weight_transpose=True,
    )
    algorithm.input_name = setting.input_name
    return fb_run(algorithm, setting)


def _layer_outputs(self: Any, layer: Any, batches_input: list[Any]) -> list[Any]:
    """FusionBench's `layer_batches_forward` for a CLIP encoder layer that returns its hidden states as a
    tensor (transformers 5) or as the first item of a tuple (transformers 4)."""
    outputs = []
    for batch in batches_input:
        output = layer(batch.to(next(layer.parameters()).device), attention_mask=None)
        outputs.append((output[0] if isinstance(output, tuple) else output).detach().cpu())
    return outputs


def fb_regmean_plusplus(setting: Setting, reduction: float) -> tuple[Any, str]:
    """FusionBench's RegMean++ for CLIP, and a note of what had to be adapted for it to run on these models.

    FusionBench 0.2.33 as shipped fails here in three ways, each adapted in a subclass / wrapper that leaves
    its algorithm (`RegMeanAlgorithmPlusPlus.run`, its hooks' Grams, `merging_with_regmean_weights`) as is:
    the class cannot be constructed; it reaches transformers 4's `model.vision_model`; and it takes `[0]` of
    an encoder layer's output, which transformers 5 returns as a tensor (`[0]` is then the first example
    without its batch dimension: on some shapes that raises, on others the next layers' Grams are wrong)."""
    import torch
    from fusion_bench.method.regmean_plusplus.clip_regmean_plusplus import RegMeanAlgorithmForCLIPPlusPlus
    from fusion_bench.method.regmean_plusplus.regmean_plusplus import RegMeanAlgorithmPlusPlus

    algorithm_class = _forward_only(RegMeanAlgorithmForCLIPPlusPlus)
    arguments = {"dataloader_kwargs": {"batch_size": 4, "num_workers": 0}, "num_regmean_examples": 10**9,
                 "exclude_param_names_regex": [], "reduce_non_diagonal_ratio": reduction, "weight_transpose": True}
    problems = []
    try:
        algorithm_class(**arguments)
    except AttributeError as err:
        # the class declares `_config_mapping` as a plain dict, but the constructor it inherits
        # (`auto_register_config`) reads `_config_mapping.inverse` (a bidict's): it fails for every caller, its
        # Hydra config too. Repaired with the mapping its parent's decorator builds.
        problems.append(f"its constructor raises {type(err).__name__}: {err} (_config_mapping a dict, not a bidict)")
        mapping = RegMeanAlgorithmPlusPlus._config_mapping | {"_dataloader_kwargs": "dataloader_kwargs"}
        algorithm_class = type(algorithm_class.__name__, (algorithm_class,), {"_config_mapping": mapping})
    wrap = None
    if not hasattr(setting.base, "vision_model"):
        problems.append("it reads model.vision_model.*, which transformers 5's CLIPVisionModel no longer has "
                        "(models handed over inside a module that restores that path)")

        class VisionModelPath(torch.nn.Module):
            def __init__(self, tower: Any) -> None:
                super().__init__()
                self.vision_model = tower

            @property
            def device(self) -> Any:
                return next(self.parameters()).device

        wrap = VisionModelPath
    layer = setting.base.vision_model.encoder.layers[0] if wrap is None else setting.base.encoder.layers[0]
    with torch.no_grad():
        probe = layer(torch.zeros(1, 2, setting.base.config.hidden_size), attention_mask=None)
    if not isinstance(probe, tuple):
        problems.append("it takes [0] of each encoder layer's output, a tensor in transformers 5, i.e. the first "
                        "example only: it raises on some shapes, else wrong Grams from the second layer on "
                        "(layer_batches_forward adapted)")
        algorithm_class = type(algorithm_class.__name__, (algorithm_class,), {"layer_batches_forward": _layer_outputs})
    merged = fb_run(algorithm_class(**arguments), setting, wrap=wrap)
    note = f"FusionBench fails as shipped: {'; '.join(problems)}. Adapted: " if problems else ""
    return (merged if wrap is None else merged.vision_model), note


# ------------------------------------------------------------------------------------------ our side
class NotInThisBuild(Exception):
    """A method, parameter or function this checkout does not have (yet)."""


def ours_merge(setting: Setting, method: str, params: dict[str, Any]) -> Any:
    from hf_featcal.merging import get_method, merge_methods, merge_models

    known = {name for m in merge_methods().values() for name in (m.name, *m.aliases)}
    if method not in known:
        raise NotInThisBuild(f"no merge method {method!r}")
    declared = get_method(method)
    missing = sorted(set(params) - {p.name for p in declared.parameters})
    if missing:
        raise NotInThisBuild(f"{method} has no parameter {', '.join(missing)}")
    if declared.needs_calibration_data:
        params = {**params, "calibration_data": setting.batches, "num_samples_per_task": None}
    return merge_models(setting.base, setting.experts, method, **params)


def ours_svc(setting: Setting, merged: Any, alpha: float) -> Any:
    try:
        from hf_featcal.merging.svc import singular_value_calibration
    except ImportError as err:
        raise NotInThisBuild(f"no hf_featcal.merging.svc.singular_value_calibration ({err})") from None
    return singular_value_calibration(merged, setting.base, setting.experts, alpha=alpha)


# ------------------------------------------------------------------------------------------ rows
@dataclass
class Case:
    """One row per model: our `method` with `params` against FusionBench's `fb_class` with `fb_params`
    (`run_ours` / `run_fb` where the plain calls do not fit)."""

    method: str
    fb_class: str  # dotted path, imported as written
    params: dict[str, Any]
    fb_params: dict[str, Any]
    label: str = ""  # the row's name when one method has several rows
    run_ours: Callable[[Setting], Any] | None = None
    run_fb: Callable[[Setting], Any] | None = None  # the merged model, or (model, a note opening the verdict)
    how: str = "run() on a BaseModelPool of the models"
    by_design: str = ""  # the whole row differs by design: why
    design_keys: Callable[[Setting, str], str | None] = field(default=lambda setting, key: None)
    skip: dict[str, str] = field(default_factory=dict)  # model -> why the row is not run on it
    context: Callable[[Setting, Any], str] | None = None  # a fact about FusionBench's result, closing the verdict

    def ours(self, setting: Setting) -> Any:
        return self.run_ours(setting) if self.run_ours else ours_merge(setting, self.method, self.params)

    def fusionbench(self, setting: Setting) -> Any:
        if self.run_fb:
            return self.run_fb(setting)
        module, _, name = self.fb_class.rpartition(".")
        return fb_run(getattr(importlib.import_module(module), name)(**self.fb_params), setting)


def _ta_merge(setting: Setting) -> Any:
    """The merged model both SVC sides calibrate: Task Arithmetic, λ = 0.3 (ours; bit-exact with FusionBench's)."""
    return ours_merge(setting, "task_arithmetic", {"scaling_factor": 0.3})


def _ties_keeping_fusionbench_count(setting: Setting) -> Any:
    """Our global trim at the density that keeps int(0.2·d) + 1 entries of each task vector of d entries, as
    FusionBench's `kthvalue` threshold does (it keeps the boundary entry too)."""
    entries = sum(v.numel() for v in setting.base.state_dict().values() if v.is_floating_point())
    density = (int(0.2 * entries) + 1.5) / entries
    return ours_merge(setting, "ties", {"scaling_factor": 0.3, "density": density, "merge_func": "mean"})


def _wudi_movement(setting: Setting, theirs: Any) -> str:
    """How far FusionBench's optimiser steps moved its 2-D tensors from where they start (the task vectors' sum),
    relative to the merge's change: the size of a difference the row would show if ours skipped them."""
    base, experts = float_state(setting.base), [float_state(e) for e in setting.experts.values()]
    moved = 0.0
    for key, value in float_state(theirs).items():
        if value.dim() == 2:
            start = base[key] + sum(e[key] - base[key] for e in experts)
            moved = max(moved, ((value - start).abs().max() / (value - base[key]).abs().max()).item())
    return f"; its optimiser steps move its matrices by max rel {moved:.1e} from the task vectors' sum"


def _lm_head_solved(setting: Setting, key: str) -> str | None:
    if setting.name == "llama" and key == "lm_head.weight":
        return ("FusionBench solves every nn.Linear with RegMean, the LM head too; ours the Linears inside the "
                "blocks, the head averaged (the RegMean paper's transformer layers)")
    return None


def _post_layernorm_kept(setting: Setting, key: str) -> str | None:
    if key.startswith("post_layernorm."):
        return "FusionBench's CLIP RegMean++ keeps the pretrained post_layernorm, ours averages it as every non-Linear"
    return None


TIES_FB = {"scaling_factor": 0.3, "threshold": 20, "remove_keys": [], "merge_func": "mean"}
REGMEAN = {"reduction": 0.9, "gram_rule": "token_mean"}
REGMEAN_FB = {"reduce_non_diagonal_ratio": 0.9, "num_regmean_examples": "all", "batch_size": 4}
REGMEAN_HOW = ("run() of a subclass whose compute_logits is the model's forward (no CLIP zero-shot head); "
               "FusionBench's hooks take the Grams (per-token mean)")
ISO = "fusion_bench.method.isotropic_merging.iso."


def cases(wudi_steps: int) -> list[Case]:
    return [
        Case("task_arithmetic", "fusion_bench.method.TaskArithmeticAlgorithm", {"scaling_factor": 0.3},
             {"scaling_factor": 0.3}),
        Case("ties", "fusion_bench.method.TiesMergingAlgorithm",
             {"scaling_factor": 0.3, "density": 0.2, "merge_func": "mean"}, TIES_FB,
             by_design="FusionBench's global trim keeps int(0.2·d) + 1 entries of each task vector (its kthvalue "
                       "threshold keeps the boundary entry), ours int(0.2·d): one entry per expert; the next row "
                       "keeps FusionBench's count"),
        Case("ties", "fusion_bench.method.TiesMergingAlgorithm",
             {"scaling_factor": 0.3, "density": "(int(0.2·d) + 1.5) / d", "merge_func": "mean"}, TIES_FB,
             label="ties (FB's count)", run_ours=_ties_keeping_fusionbench_count),
        Case("tsv_m", "fusion_bench.method.TaskSingularVectorMerging", {"scaling_factor": 1.0},
             {"alpha": 1.0, "exclude_keys": None}),
        Case("iso_c", ISO + "IsotropicMergingInCommonSubspace", {"scaling_factor": 1.0},
             {"scaling_factor": 1.0, "exclude_keys": None}),
        Case("iso_cts", ISO + "IsotropicMergingInCommonAndTaskSubspace",
             {"scaling_factor": 1.0, "common_space_fraction": 0.8},
             {"scaling_factor": 1.0, "common_space_fraction": 0.8, "exclude_keys": None}),
        # FusionBench's Adam learning rate is fixed at 1e-5
        Case("wudi", "fusion_bench.method.WUDIMerging", {"iter_num": wudi_steps, "lr": 1e-5},
             {"iter_num": wudi_steps, "exclude_keys": None}, context=_wudi_movement),
        Case("regmean", "fusion_bench.method.regmean.clip_regmean.RegMeanAlgorithmForCLIP", REGMEAN, REGMEAN_FB,
             run_fb=lambda s: fb_regmean(s, 0.9), how=REGMEAN_HOW, design_keys=_lm_head_solved),
        Case("regmean", "fusion_bench.method.regmean.clip_regmean.RegMeanAlgorithmForCLIP",
             {**REGMEAN, "gram_rule": "sum"}, REGMEAN_FB, label="regmean (Gram sum)",
             run_fb=lambda s: fb_regmean(s, 0.9), how=REGMEAN_HOW,
             by_design="ours sums each task's Gram (the RegMean paper, our default), FusionBench averages it per "
                       "token; the tasks bring 8, 6 and 9 examples (the previous row: the per-token mean, as FB)"),
        Case("regmean_plusplus", "fusion_bench.method.regmean_plusplus.clip_regmean_plusplus."
             "RegMeanAlgorithmForCLIPPlusPlus", {"reduction": 0.95, "gram_rule": "token_mean"},
             {**REGMEAN_FB, "reduce_non_diagonal_ratio": 0.95}, run_fb=lambda s: fb_regmean_plusplus(s, 0.95),
             how="run() of a subclass without CLIP zero-shot head, adapted where the verdict says; FusionBench's "
                 "hooks take the Grams (per-token mean)",
             design_keys=_post_layernorm_kept,
             skip={"llama": "FusionBench 0.2.33 implements RegMean++ for CLIP vision towers only"}),
        Case("svc", "fusion_bench.method.singular_value_calibration.svc.SingularValueCalibration", {"alpha": 0.1},
             {"alpha": 0.1, "accelerator": "cpu"}, run_ours=lambda s: ours_svc(s, _ta_merge(s), 0.1),
             run_fb=lambda s: fb_run(_fb_class("singular_value_calibration.svc.SingularValueCalibration")(
                 alpha=0.1, accelerator="cpu"), s, {"_merged_": _ta_merge(s)}),
             how="run() on a BaseModelPool whose _merged_ is our Task Arithmetic merge (λ 0.3, bit-exact with FB's)"),
    ]


# ------------------------------------------------------------------------------------------ comparison
def float_state(model: Any) -> dict[str, Any]:
    return {k: v.detach() for k, v in model.state_dict().items() if v.is_floating_point()}


def differences(setting: Setting, ours: Any, theirs: Any,
                design: Callable[[Setting, str], str | None]) -> dict[str, Any]:
    """Max abs / max rel over the tensors not named by `design`, the worst tensor, and those named."""
    ours_sd, theirs_sd, base_sd = float_state(ours), float_state(theirs), float_state(setting.base)
    if ours_sd.keys() != theirs_sd.keys():
        raise AssertionError(f"the merged models' tensors differ: {sorted(ours_sd.keys() ^ theirs_sd.keys())}")
    max_abs, max_rel, worst, set_apart = 0.0, 0.0, None, {}
    for key, theirs_value in theirs_sd.items():
        delta = (ours_sd[key].double() - theirs_value.double()).abs().max().item()
        change = (theirs_value.double() - base_sd[key].double()).abs().max().item()
        scale = change if change > 0 else theirs_value.double().abs().max().item()
        rel = delta / scale if scale > 0 else (0.0 if delta == 0 else float("inf"))
        reason = design(setting, key)
        if reason is not None:
            set_apart[key] = {"reason": reason, "max_abs": delta, "max_rel": rel}
            continue
        max_abs = max(max_abs, delta)
        if rel > max_rel:
            max_rel, worst = rel, key
    return {"max_abs": max_abs, "max_rel": max_rel, "worst_tensor": worst, "by_design_tensors": set_apart}


def verdict(case: Case, numbers: dict[str, Any]) -> str:
    if case.by_design:
        return f"differs by design: {case.by_design}"
    if numbers["max_abs"] == 0:
        text = "bit-exact"
    elif numbers["max_rel"] <= FLOAT32_RTOL:
        text = f"float32 rounding (max rel {numbers['max_rel']:.1e})"
    else:
        text = f"DIFFERS (max rel {numbers['max_rel']:.1e} at {numbers['worst_tensor']}): unexplained"
    reasons: dict[str, list[str]] = {}
    for key, entry in numbers["by_design_tensors"].items():
        reasons.setdefault(entry["reason"], []).append(key)
    for reason, keys in reasons.items():
        text += f"; {', '.join(keys)} differ by design: {reason}"
    return text


def run_case(case: Case, setting: Setting) -> dict[str, Any]:
    row: dict[str, Any] = {
        "method": case.label or case.method, "model": setting.name, "fusionbench_class": case.fb_class,
        "how_fusionbench_is_called": case.how, "inputs": setting.description, "ours_params": case.params,
        "fusionbench_params": case.fb_params, "max_abs": None, "max_rel": None,
    }
    if setting.name in case.skip:
        return {**row, "verdict": f"not compared: {case.skip[setting.name]}"}
    start = time.perf_counter()
    try:
        ours = case.ours(setting)
    except NotInThisBuild as err:
        return {**row, "verdict": f"not in this build ({err})"}
    except Exception as err:  # noqa: BLE001 - one failing method must not hide the other rows
        row["ours_traceback"] = traceback.format_exc()
        return {**row, "verdict": f"OURS FAILS: {type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    row["ours_seconds"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    try:
        theirs = case.fusionbench(setting)
    except Exception as err:  # noqa: BLE001 - FusionBench's own failure is the row's result
        row["fusionbench_traceback"] = traceback.format_exc()
        return {**row, "verdict": f"FusionBench fails: {type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    row["fusionbench_seconds"] = round(time.perf_counter() - start, 3)
    theirs, note = theirs if isinstance(theirs, tuple) else (theirs, "")
    numbers = differences(setting, ours, theirs, case.design_keys)
    closing = case.context(setting, theirs) if case.context else ""
    return {**row, **numbers, "verdict": note + verdict(case, numbers) + closing}


def markdown(rows: list[dict[str, Any]], settings: list[Setting]) -> str:
    def params(values: dict[str, Any]) -> str:
        return ", ".join(f"{k}={v}" for k, v in values.items())

    lines = ["| method | model | FusionBench class | inputs | max abs diff | max rel diff | verdict |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        numbers = ["—" if row[k] is None else f"{row[k]:.2e}" for k in ("max_abs", "max_rel")]
        inputs = f"ours: {params(row['ours_params'])}; FB: {params(row['fusionbench_params'])}"
        lines.append(f"| {row['method']} | {row['model']} | `{row['fusionbench_class']}` | {inputs} | "
                     f"{numbers[0]} | {numbers[1]} | {row['verdict']} |")
    lines.append("")
    lines += [f"- {s.name}: {s.description}; experts = base + N(0, {NOISE_STD}²) on every parameter" for s in settings]
    calls = {row["method"]: row["how_fusionbench_is_called"] for row in rows}
    lines.append(f"- FusionBench is called by {Case.how} (deep copies), except:")
    lines += [f"  - {method}: {how}" for method, how in calls.items() if how != Case.how]
    return "\n".join(lines)


def versions() -> dict[str, str]:
    import importlib.metadata

    import hf_featcal

    found = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "fusion-bench")}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    found["hf_featcal"] = f"{hf_featcal.__file__} @ {commit.stdout.strip() or 'unknown'}"
    found["python"] = platform.python_version()
    return found


def run(args: argparse.Namespace) -> None:
    import torch

    logging.getLogger("fusion_bench").setLevel(logging.ERROR)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    torch.set_grad_enabled(True)  # WUDI optimises; every merge sets no_grad itself
    builders = {"clip": clip_setting, "llama": llama_setting}
    settings = [builders[name]() for name in args.models.split(",")]
    for setting in settings:
        check_inputs(setting)
    selected = None if args.methods is None else set(args.methods.split(","))
    rows = []
    started = time.perf_counter()
    for case in cases(args.wudi_steps):
        if selected is not None and case.method not in selected and case.label not in selected:
            continue
        for setting in settings:
            rows.append(run_case(case, setting))
            print(f"{rows[-1]['method']:>18} {setting.name:>6}: {rows[-1]['verdict']}", flush=True)
    seconds = time.perf_counter() - started
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "seconds": round(seconds, 1),
              "versions": versions(), "float32_rtol": FLOAT32_RTOL, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print()
    print(markdown(rows, settings))
    print(f"\n{len(rows)} rows in {seconds:.0f} s; JSON: {args.output}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.no_venv and os.environ.get(INNER_ENV) != "1":
        venv = args.venv or Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)
        rerun_inside(ensure_venv(venv.resolve(), args.torch), argv)
    if str(REPO / "src") not in sys.path:  # --no-venv: this checkout's code all the same
        sys.path.insert(0, str(REPO / "src"))
    run(args)


if __name__ == "__main__":
    main()
