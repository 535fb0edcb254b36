"""A CLIP ViT-B/32 encoder layer's forward with plain and with packed Linear weights
(`hf_featcal.packed_linears`), alternating, and whether the outputs are the same bit for bit.

    .venv/bin/python benchmarks/packed_linears.py [--images 16] [--batches 32] [--rounds 8]

Each round runs `--batches` batches of `--images` images (50 tokens each) through one layer, as a
FeatCal pass runs a block's batches; the first three calls of a row count are the plain product
(the third also tries the packed one), so they are left out of the timing. Prints the median and
the best milliseconds per forward of each variant.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import CLIPVisionConfig, CLIPVisionModel

from hf_featcal.activations import lean_activations
from hf_featcal.packed_linears import TRY_AT_CALL, available, packed_linears


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("this torch has no MKL packed linear kernels")
    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=1, num_attention_heads=12,
                              image_size=224, patch_size=32)
    model = CLIPVisionModel(config).eval()
    layer = model.vision_model.encoder.layers[0] if hasattr(model, "vision_model") else model.encoder.layers[0]
    batches = [torch.randn(args.images, 50, 768) for _ in range(args.batches)]

    def run(packed: bool) -> tuple[float, list[torch.Tensor]]:
        with torch.no_grad(), lean_activations(layer), packed_linears(layer) if packed else torch.no_grad():
            outputs = [layer(x, None) for x in batches[:TRY_AT_CALL]]
            start = time.perf_counter()
            outputs += [layer(x, None) for x in batches[TRY_AT_CALL:]]
            seconds = (time.perf_counter() - start) / (len(batches) - TRY_AT_CALL)
        return seconds * 1e3, [o[0] if isinstance(o, tuple) else o for o in outputs]

    times: dict[bool, list[float]] = {False: [], True: []}
    same = True
    for round_ in range(args.rounds):
        results = {}
        for packed in (False, True) if round_ % 2 else (True, False):
            times[packed].append((results.setdefault(packed, run(packed)))[0])
        same &= all(torch.equal(a, b) for a, b in zip(results[False][1], results[True][1]))
    for packed, values in times.items():
        print(f"{'packed' if packed else 'plain '}: median {statistics.median(values):.2f} ms, best {min(values):.2f} ms per forward")
    print(f"outputs bit-identical: {same}")


if __name__ == "__main__":
    main()
