"""Builders shared by the tests (test files import them from here; conftest.py keeps the fixtures):
tiny random-init CLIP configs and models (no hub access), perturbed experts and their task-arithmetic
merge, pixel batches, the whole tiny CLIP setting, its float64 copy, and the comparison of two runs of
one calibration up to float32 rounding."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from types import ModuleType

import torch
from transformers import CLIPConfig, CLIPVisionConfig, CLIPVisionModel

#: The merge methods this build ships, in the registry's order (the tests that pin the CLI, schema and grid
#: order compare against this one list).
SHIPPED_METHODS = [
    "average", "task_arithmetic", "ties", "dare", "dare_ties", "tsv_m", "iso_c", "iso_cts", "wudi",
    "regmean", "regmean_plusplus",
]


def tiny_vision_config(**overrides) -> CLIPVisionConfig:
    values = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
        num_channels=3,
    )
    values.update(overrides)
    return CLIPVisionConfig(**values)


def tiny_clip_config(**vision_overrides) -> CLIPConfig:
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                bos_token_id=0, eos_token_id=1, pad_token_id=1, max_position_embeddings=16)
    return CLIPConfig(vision_config=tiny_vision_config(**vision_overrides).to_dict(), text_config=text,
                      projection_dim=8)


def randomise_norms(model: torch.nn.Module, generator: torch.Generator, scale: float = 0.2) -> None:
    """Give every LayerNorm a non-trivial affine (random init has γ=1, β=0, which makes the Linears
    after it see a singular Gram)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.add_(scale * torch.randn(module.weight.shape, generator=generator))
                module.bias.add_(scale * torch.randn(module.bias.shape, generator=generator))


def perturbed(model: torch.nn.Module, generator: torch.Generator, scale: float) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise of standard deviation `scale` added to every parameter."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return out


def task_arithmetic(base: torch.nn.Module, experts: dict, scaling: float = 0.3) -> torch.nn.Module:
    """base + scaling·Σ(expert − base) on every floating tensor: the tests' own Task Arithmetic,
    independent of `hf_featcal.merging`."""
    merged = copy.deepcopy(base)
    base_sd = base.state_dict()
    with torch.no_grad():
        for name, value in merged.state_dict().items():
            if value.is_floating_point():
                value.copy_(base_sd[name]
                            + scaling * sum(e.state_dict()[name] - base_sd[name] for e in experts.values()))
    return merged


def pixel_batches(generator: torch.Generator, sizes: list[int], image_size: int = 8) -> list[dict]:
    """Random image batches of `sizes` examples each, as a CLIP vision tower takes them."""
    return [{"pixel_values": torch.randn(n, 3, image_size, image_size, generator=generator)} for n in sizes]


def build_clip_setting(generator: torch.Generator, batch_sizes: tuple[int, ...] = (5, 5, 3)):
    """A base CLIPVisionModel, two experts, their task-arithmetic merge and calibration batches."""
    base = CLIPVisionModel(tiny_vision_config()).eval()
    randomise_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("cars", "dtd")}
    merged = task_arithmetic(base, experts)
    data = {t: pixel_batches(generator, list(batch_sizes)) for t in experts}
    return base, experts, merged, data


def as_float64(base, experts, merged, data):
    """The same setting in float64 (models and every floating batch tensor): comparisons between two
    computations of one result (e.g. one process vs two) are then exact to ~1e-12, not to float32
    round-off times the Grams' condition numbers, which depends on the CPU."""
    def cast(batch):
        return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}

    return (base.double(), {t: e.double() for t, e in experts.items()}, merged.double(),
            {t: [cast(b) for b in batches] for t, batches in data.items()})


#: How far apart two float32 runs of one calibration may lie when they differ only in where tensors
#: live (in-memory models against memory-mapped checkpoint files, ...): MKL picks its kernels by CPU and
#: by memory alignment, so the same products can round differently. Measured: bit-identical on an
#: Intel Xeon, 7.7e-7 norm-wise relative at worst on an AMD EPYC (bit-identical there too with
#: MKL_CBWR=COMPATIBLE). A wrong input (another expert, a dropped bias) moves weights by 1e-3 or more.
SAME_RESULT_RTOL = 1e-5


def assert_same_up_to_rounding(actual, expected, rtol: float = SAME_RESULT_RTOL) -> None:
    """Each tensor of `actual` is within `rtol` of `expected`'s in norm-wise relative distance,
    ‖a − e‖ ≤ rtol·‖e‖ + 1e-7·√numel (the second term only matters for tensors near zero). Both are
    state dicts, or iterables of (name, tensor) pairs in the same order (e.g. `named_parameters()`)."""
    pairs_a = list(actual.items() if isinstance(actual, dict) else actual)
    pairs_e = list(expected.items() if isinstance(expected, dict) else expected)
    assert [n for n, _ in pairs_a] == [n for n, _ in pairs_e], "the two models name their tensors differently"
    for (name, a), (_, e) in zip(pairs_a, pairs_e, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, e.shape, a.dtype, e.dtype)
        if not e.is_floating_point():
            assert torch.equal(a, e), name
            continue
        a, e = a.detach().double(), e.detach().double()
        distance, bound = float((a - e).norm()), rtol * float(e.norm()) + 1e-7 * e.numel() ** 0.5
        assert distance <= bound, f"{name}: ‖a − e‖ = {distance:.3g} > {bound:.3g} (‖e‖ = {float(e.norm()):.3g})"


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every state-dict tensor (to check later that a call left the model as it was)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    current = model.state_dict()
    assert current.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(current[key], value), key


SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def import_source(folder, file_name: str, source: str, module_name: str) -> ModuleType:
    """`source` written to `folder/file_name` and imported as `module_name` (a registry test's added file)."""
    path = os.path.join(folder, file_name)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_two_processes(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`args` (a script and its arguments, or ``-m module ...``) run as two CPU processes by
    ``torch.distributed.run`` on a free local port, one thread each, without the launcher variables
    this process may carry; its output captured."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def loads_torch(code: str) -> bool:
    """Whether running `code` in a fresh interpreter (this tree's package first) imports torch."""
    script = f"import json, sys\n{code}\nprint(json.dumps('torch' in sys.modules))"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def hub_stand_in(monkeypatch, *, public: tuple[str, ...] = (), private: tuple[str, ...] = (),
                 token: str | None = "hf_test_token") -> dict:
    """The hub cannot be reached here: huggingface_hub's `create_repo`, `upload_folder` and `repo_info`
    record what they receive (`upload_folder`: every file under the uploaded folder as it reads it, as
    bytes); `repo_info` knows the repositories `public` and `private` and raises huggingface_hub's own
    RepositoryNotFoundError for any other. `token` is the HF_TOKEN seen (None: no token anywhere)."""
    import os

    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr("huggingface_hub.get_token", lambda: None)  # nor a login's token file
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    calls: dict = {"create_repo": [], "upload_folder": [], "repo_info": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"].append((repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, **kwargs):
        assert kwargs.get("allow_patterns") is None and kwargs.get("ignore_patterns") is None
        files = {os.path.relpath(os.path.join(root, name), folder_path): open(os.path.join(root, name), "rb").read()
                 for root, _, names in os.walk(folder_path) for name in names}
        calls["upload_folder"].append((repo_id, files, kwargs))
        return "commit-info"

    def repo_info(self, repo_id, **kwargs):
        calls["repo_info"].append(repo_id)
        if repo_id in public or repo_id in private:
            return type("RepoInfo", (), {"id": repo_id, "private": repo_id in private})()
        url = f"https://huggingface.co/api/models/{repo_id}"
        raise RepositoryNotFoundError(f"404: {repo_id}", response=httpx2.Response(
            404, request=httpx2.Request("GET", url)))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(HfApi, "repo_info", repo_info)
    return calls


def record_prepared_batches(monkeypatch) -> dict:
    """task → the calibration batches `FeatCalCalibrator` prepares (the library's own `prepare_batches`,
    recorded as it returns them: a one-stack tower's calibrator lets them go once their streams entered)."""
    import hf_featcal.calibrator as calibrator_module

    prepare = calibrator_module.prepare_batches
    prepared: dict = {}

    def recording(task, *args, **kwargs):
        prepared[task] = prepare(task, *args, **kwargs)
        return prepared[task]

    monkeypatch.setattr(calibrator_module, "prepare_batches", recording)
    return prepared
