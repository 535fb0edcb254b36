"""Print a SHA-256 of the weights every merge method and FeatCal produce on fixed tiny settings.

The gate for refactors that must leave behaviour unchanged: run it before and after, the lines must be
equal (bit-identical weights). Uses only public entry points that every revision since the merge
registry has had (`merging.merge_models`, `regmean.regmean_merging` / the registry, `FeatCalCalibrator`).

    python scripts/weights_fingerprint.py > before.txt   # on the old revision
    python scripts/weights_fingerprint.py | diff before.txt -
"""

from __future__ import annotations

import copy
import hashlib
import importlib

import torch
from transformers import BertConfig, BertModel, CLIPVisionConfig, CLIPVisionModel, T5Config, T5ForConditionalGeneration

from hf_featcal import FeatCalCalibrator, FeatCalConfig

torch.set_num_threads(1)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def perturbed(model, generator, scale):
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return out


def setting(kind: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "clip":
        base = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, image_size=8, patch_size=4)).eval()
        batches = lambda: [{"pixel_values": torch.randn(4, 3, 8, 8, generator=g)} for _ in range(2)]  # noqa: E731
    elif kind == "bert":
        base = BertModel(BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    vocab_size=50, max_position_embeddings=16), add_pooling_layer=False).eval()
        batches = lambda: [{"input_ids": torch.randint(0, 50, (4, 6), generator=g)} for _ in range(2)]  # noqa: E731
    else:
        base = T5ForConditionalGeneration(T5Config(d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=2,
                                                   vocab_size=50, decoder_start_token_id=0)).eval()
        batches = lambda: [{"input_ids": torch.randint(0, 50, (4, 6), generator=g),  # noqa: E731
                            "labels": torch.randint(0, 50, (4, 3), generator=g)} for _ in range(2)]
    with torch.no_grad():
        for m in base.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.add_(0.2 * torch.randn(m.weight.shape, generator=g))
    experts = {t: perturbed(base, g, 0.05).eval() for t in ("a", "b", "c")}
    data = {t: batches() for t in experts}
    return base, experts, data


def main() -> None:
    merging = importlib.import_module("hf_featcal.merging")
    for kind in ("clip", "bert", "t5"):
        base, experts, data = setting(kind)
        for method, params in [("average", {}), ("task_arithmetic", {"scaling_factor": 0.3}),
                               ("ties", {"scaling_factor": 0.5, "density": 0.3}),
                               ("dare", {"scaling_factor": 0.3, "drop_rate": 0.5, "seed": 3}),
                               ("dare_ties", {"scaling_factor": 0.3, "drop_rate": 0.5, "seed": 3})]:
            print(kind, method, digest(merging.merge_models(base, experts, method, **params)))
        regmean = importlib.import_module("hf_featcal.regmean") if importlib.util.find_spec(
            "hf_featcal.regmean") else importlib.import_module("hf_featcal.merging.regmean")
        print(kind, "regmean", digest(regmean.regmean_merging(base, experts, data, reduction=0.9)))
        merged = merging.merge_models(base, experts, "task_arithmetic", scaling_factor=0.3)
        # the methods added later, printed only by a revision that has them (the lines above stay comparable)
        offered = merging.merge_methods() if hasattr(merging, "merge_methods") else {}
        for method, params in [("tsv_m", {}), ("iso_c", {}), ("iso_cts", {"common_space_fraction": 0.5}),
                               ("wudi", {"iter_num": 20, "lr": 1e-3})]:
            if method in offered:
                print(kind, method, digest(merging.merge_models(base, experts, method, **params)))
        for method, params in [("regmean", {"gram_rule": "token_mean"}), ("regmean_plusplus", {})]:
            if method in offered and "gram_rule" in offered[method].declared():
                label = f"{method}-{params['gram_rule']}" if params else method
                print(kind, label, digest(merging.merge_models(base, experts, method, calibration_data=data, **params)))
        if hasattr(merging, "singular_value_calibration"):
            print(kind, "task_arithmetic+svc", digest(merging.singular_value_calibration(merged, base, experts,
                                                                                         alpha=0.1)))
        for name, config in [("featcal", FeatCalConfig()), ("featcal-fast", FeatCalConfig(forward_dtype="bfloat16")),
                             ("featcal-module", FeatCalConfig(granularity="module")),
                             ("featcal-nobase", FeatCalConfig(teacher_alpha=0.5, lambda_ratio=0.1))]:
            model = copy.deepcopy(merged)
            calibrated = FeatCalCalibrator(model, None if name.endswith("nobase") else base, experts, data,
                                           config, show_progress=False).calibrate()
            print(kind, name, digest(calibrated))


if __name__ == "__main__":
    main()
