"""Fast mode (`FeatCalConfig.forward_dtype`): block forwards under torch.autocast, low-precision Gram
products, float32 statistics and solves — on tiny CLIP vision, T5 and Llama models built from configs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, T5ForConditionalGeneration

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal import statistics as statistics_module
from hf_featcal._kernels import gram
from test_llm import llm_config, lm_batch, randomise_rms_norms
from test_t5 import randomise_t5_norms, seq2seq_batch, t5_config
from testing_utils import build_clip_setting, perturbed, task_arithmetic

# ‖P_fast − P_exact‖_F / ‖P_exact‖_F over the calibrated parameter tensors, measured on these tiny
# models (this CPU, bfloat16, float32 products from MKL's mixed GEMM): max 8.0e-3 (CLIP, last fc2
# bias), 3.4e-3 (T5, last decoder wo), 7.0e-3 (Llama, last down_proj); float16: 1.2e-3, 4.2e-4, 9.6e-4
# (with products rounded to the low dtype: 9.5e-3, 6.7e-3, 9.0e-3; 1.3e-3, 7.9e-4, 1.1e-3). The bound
# is ~5× the largest.
# A run whose statistics leave out the expert (teacher_alpha = 0, the teacher = the student) is
# 0.16 / 0.095 / 0.54 from exact mode, above it (checked below, so the bound keeps its meaning).
RELATIVE_TOLERANCE = 5e-2
# bfloat16 rounds at 2⁻⁸ ≈ 4e-3: a fast mode that silently ran in float32 would be ~1e-7 from exact mode
LOW_PRECISION_FLOOR = 1e-4


def _t5(generator):
    base = T5ForConditionalGeneration(t5_config()).eval()
    randomise_t5_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("cola", "sst2")}
    data = {t: [seq2seq_batch(generator), seq2seq_batch(generator)] for t in experts}
    return base, experts, task_arithmetic(base, experts), data


def _llama(generator):
    base = AutoModelForCausalLM.from_config(llm_config("llama")).eval()
    randomise_rms_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("math", "code")}
    data = {t: [lm_batch(generator), lm_batch(generator)] for t in experts}
    return base, experts, task_arithmetic(base, experts), data


SETTINGS = {"clip": build_clip_setting, "t5": _t5, "llama": _llama}


def _global_precision_state():
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )


@pytest.fixture(autouse=True)
def _no_global_precision_change():
    """No run (fast or exact) may change process-wide precision settings or leave autocast on."""
    before = _global_precision_state()
    yield
    after = _global_precision_state()
    torch.set_float32_matmul_precision(before[0])  # keep later tests independent of a failure here
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[1], before[2]
    assert after == before


def _calibrated(merged, base, experts, data, **config):
    """A calibrated copy of `merged` (the original is left as it is)."""
    model = copy.deepcopy(merged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ridge warnings of the tiny Grams
        FeatCalCalibrator(model, base, experts, data, FeatCalConfig(**config), show_progress=False).calibrate()
    return model


def _relative_differences(model, reference, merged) -> dict[str, float]:
    """‖P − P_ref‖_F / ‖P_ref‖_F for every parameter tensor that `reference`'s calibration changed."""
    params, before = dict(model.named_parameters()), dict(merged.named_parameters())
    out = {}
    for name, ref in reference.named_parameters():
        if torch.equal(ref, before[name]):
            continue
        ref64 = ref.detach().double()
        out[name] = float((params[name].detach().double() - ref64).norm() / ref64.norm())
    return out


@pytest.mark.parametrize("family", list(SETTINGS))
def test_bfloat16_close_to_exact_mode(family, generator):
    base, experts, merged, data = SETTINGS[family](generator)
    exact = _calibrated(merged, base, experts, data)
    fast = _calibrated(merged, base, experts, data, forward_dtype="bfloat16")
    # the calibrated model keeps the merged model's dtypes and device
    for (name, p), (_, q) in zip(fast.named_parameters(), merged.named_parameters(), strict=True):
        assert (p.dtype, p.device) == (q.dtype, q.device) == (torch.float32, torch.device("cpu")), name
    differences = _relative_differences(fast, exact, merged)
    assert len(differences) >= 10  # every block's Linears and norms were calibrated
    assert all(torch.isfinite(p).all() for p in fast.parameters())
    worst = max(differences, key=differences.get)
    assert differences[worst] <= RELATIVE_TOLERANCE, (worst, differences[worst])
    assert differences[worst] >= LOW_PRECISION_FLOOR, "fast mode gave exact mode's result: forward_dtype ignored?"
    # the bound separates: statistics without the expert's contribution are further from exact mode
    student_only = _calibrated(merged, base, experts, data, teacher_alpha=0.0)
    assert max(_relative_differences(student_only, exact, merged).values()) > RELATIVE_TOLERANCE


def test_float16_close_to_exact_mode(generator):
    base, experts, merged, data = build_clip_setting(generator)
    exact = _calibrated(merged, base, experts, data)
    fast = _calibrated(merged, base, experts, data, forward_dtype="float16")
    differences = _relative_differences(fast, exact, merged)
    assert LOW_PRECISION_FLOOR <= max(differences.values()) <= RELATIVE_TOLERANCE
    assert all(p.dtype == torch.float32 for p in fast.parameters())


def _linear_output_dtypes(model, run):
    """The dtypes of the outputs of every Linear of `model` while `run()` runs."""
    seen = set()
    handles = [m.register_forward_hook(lambda _m, _a, out: seen.add(out.dtype))
               for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("forward_dtype,expected",
                         [(None, torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_block_forwards_run_in_the_forward_dtype(generator, forward_dtype, expected):
    base, experts, merged, data = build_clip_setting(generator)
    model = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(model, base, experts, data, FeatCalConfig(forward_dtype=forward_dtype),
                                   show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seen = _linear_output_dtypes(model, calibrator.calibrate)
    assert seen == {expected}
    # nothing of the autocast is left behind: the calibrated model's own forward is float32 again
    assert not torch.is_autocast_enabled("cpu")
    pixels = data["cars"][0]["pixel_values"]
    with torch.no_grad():
        assert _linear_output_dtypes(model, lambda: model(pixel_values=pixels)) == {torch.float32}
        assert model(pixel_values=pixels).last_hidden_state.dtype == torch.float32


@pytest.mark.parametrize("value", ["bf16", "float64", "float32", "BFLOAT16", "", torch.bfloat16, 16])
def test_invalid_forward_dtype_rejected(value):
    with pytest.raises(ValueError, match=r"FeatCalConfig\.forward_dtype"):
        FeatCalConfig(forward_dtype=value)
    config = FeatCalConfig(forward_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"FeatCalConfig\.forward_dtype"):
        config.forward_dtype = value
    assert config.forward_dtype == "bfloat16"  # the refused assignment keeps the old value


def test_forward_dtype_saved_and_loaded(tmp_path):
    FeatCalConfig(forward_dtype="float16").save_pretrained(tmp_path)
    assert FeatCalConfig.from_pretrained(tmp_path).forward_dtype == "float16"
    assert FeatCalConfig().forward_dtype is None  # exact mode is the default


def test_exact_mode_unaffected_by_a_fast_run(generator):
    """An exact run after a fast one (same process, same inputs) is bit-equal to one before it: the
    fast path leaves no autocast, precision flag or cached cast behind."""
    base, experts, merged, data = build_clip_setting(generator)
    before = _calibrated(merged, base, experts, data)
    fast = _calibrated(merged, base, experts, data, forward_dtype="bfloat16")
    after = _calibrated(merged, base, experts, data, forward_dtype=None)
    changed = 0
    for (name, p), (_, q), (_, m), (_, f) in zip(
        after.named_parameters(),
        before.named_parameters(),
        merged.named_parameters(),
        fast.named_parameters(),
        strict=True,
    ):
        assert torch.equal(p, q), name
        changed += not torch.equal(p, m)
        assert torch.equal(f, m) == torch.equal(p, m), name  # both modes calibrate the same tensors
    assert changed >= 10


class _MatrixProducts(TorchDispatchMode):
    """Records (input dtypes, output shape, contracted length) of every aten mm/addmm/addmm_."""

    def __init__(self):
        super().__init__()
        self.products = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = (args[0], args[1]) if func.overloadpacket is torch.ops.aten.mm else (args[1], args[2])
            self.products.append(((a.dtype, b.dtype), tuple(out.shape), a.shape[1]))
        return out


@pytest.mark.parametrize("forward_dtype, low_pays", [(None, True), ("bfloat16", True), ("bfloat16", False)])
def test_gram_products_take_the_forward_dtype(generator, forward_dtype, low_pays, monkeypatch):
    """The statistics' products (d×d outputs, contracted over the batch's tokens: 5 images × 5 tokens)
    take bfloat16 factors in fast mode where such products pay (`_kernels.gemm.low_precision_products_pay`:
    an AMX CPU, a CPU with AVX-512 BF16, a GPU; forced here) and float32 ones in exact mode and where
    they do not, whether torch computes them (aten mm/addmm) or MKL does (`_kernels.mkl_products.addmm_low_`,
    fast mode on an AMX CPU)."""
    monkeypatch.setattr(statistics_module, "low_precision_products_pay", lambda dtype, device: low_pays)
    base, experts, merged, data = build_clip_setting(generator, batch_sizes=(5, 5))
    widths = (16, 32)  # hidden size and MLP width of the tiny model
    recorder = _MatrixProducts()
    addmm_low_ = gram.addmm_low_

    def recording_addmm_low_(out, a, b, beta=1.0):
        done = addmm_low_(out, a, b, beta)
        if done:
            recorder.products.append(((a.dtype, b.dtype), tuple(out.shape), a.shape[1]))
        return done

    monkeypatch.setattr(gram, "addmm_low_", recording_addmm_low_)
    with warnings.catch_warnings(), recorder:
        warnings.simplefilter("ignore")
        FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, FeatCalConfig(forward_dtype=forward_dtype),
                          show_progress=False).calibrate()
    statistics = {
        dtypes for dtypes, shape, inner in recorder.products if shape[0] == shape[1] in widths and inner == 25
    }
    expected = torch.bfloat16 if forward_dtype is not None and low_pays else torch.float32
    assert statistics == {(expected, expected)}
