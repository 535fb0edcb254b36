"""Benchmark: FeatCal on a Llama-geometry decoder (random init, synthetic task vectors, experts on disk).

Shows that a multi-billion-parameter merge fits one machine: peak memory ≈ merged model + its
snapshot + one block of the base and of one expert + the streams, whatever the number of experts.

    python benchmarks/bench_llama.py --geometry 1b --sweep 1,4 --sequences 4 --length 128      # CPU memory
    python benchmarks/bench_llama.py --geometry 3b --device cuda --dtype bfloat16 --tasks 4 \\
        --sequences 64 --length 512                                                         # GPU variant

Writing the random-init checkpoints takes disk: about (tasks + 2) × model size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

GEOMETRIES = {
    # ~1.1 B parameters (Llama-3.2-1B layout with a 32k vocabulary)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    # Llama-3.2-3B layout
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256),
    # a small one to try the script
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1000),
}


def _config(geometry: str):
    from transformers import LlamaConfig

    return LlamaConfig(**GEOMETRIES[geometry], max_position_embeddings=4096, tie_word_embeddings=False)


def prepare(workdir: str, geometry: str, tasks: int, dtype: torch.dtype) -> None:
    """Base, `tasks` experts (base + a small random task vector each) and their Task-Arithmetic merge,
    written tensor by tensor so that at most the base, the merge and one expert are in memory."""
    from transformers import LlamaForCausalLM

    marker = os.path.join(workdir, f"ready-{geometry}-{tasks}.json")
    if os.path.exists(marker):
        return
    torch.manual_seed(0)
    base = LlamaForCausalLM(_config(geometry)).to(dtype).eval()
    if not os.path.isdir(os.path.join(workdir, "base")):
        base.save_pretrained(os.path.join(workdir, "base"))
    state = base.state_dict()
    merged = {k: v.clone() for k, v in state.items()}
    for i in range(tasks):
        expert = LlamaForCausalLM(_config(geometry)).to(dtype)
        gen = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for k, v in expert.state_dict().items():
                tau = 0.01 * state[k].float().std().clamp_min(1e-3) * torch.randn(v.shape, generator=gen)
                v.copy_(state[k] + tau.to(dtype))
                merged[k] += (0.3 * tau).to(dtype)
        path = os.path.join(workdir, f"expert-{i}")
        if not os.path.isdir(path):
            expert.save_pretrained(path)
        del expert
    model = LlamaForCausalLM(_config(geometry)).to(dtype)
    model.load_state_dict(merged)
    model.save_pretrained(os.path.join(workdir, f"merged-{tasks}"))
    with open(marker, "w") as handle:
        json.dump({"tasks": tasks}, handle)


def measure(args: argparse.Namespace) -> dict:
    from transformers import LlamaForCausalLM

    from hf_featcal import FeatCalCalibrator, FeatCalConfig

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    merged = LlamaForCausalLM.from_pretrained(os.path.join(args.workdir, f"merged-{args.tasks}"), dtype=dtype).eval()
    experts = {f"task{i}": os.path.join(args.workdir, f"expert-{i}") for i in range(args.tasks)}
    vocab = GEOMETRIES[args.geometry]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    data = {
        task: [{"input_ids": torch.randint(0, vocab, (min(args.batch_size, args.sequences - s), args.length), generator=gen),
                "attention_mask": torch.ones(min(args.batch_size, args.sequences - s), args.length, dtype=torch.long)}
               for s in range(0, args.sequences, args.batch_size)]
        for task in experts
    }
    calibrator = FeatCalCalibrator(merged, os.path.join(args.workdir, "base"), experts, data,
                                   FeatCalConfig(num_samples_per_task=args.sequences), device=device,
                                   show_progress=False)
    calibrator.profile = True
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    calibrator.calibrate()
    return {
        "geometry": args.geometry,
        "parameters_billion": sum(p.numel() for p in merged.parameters()) / 1e9,
        "tasks": args.tasks,
        "sequences_per_task": args.sequences,
        "tokens_per_sequence": args.length,
        "device": str(device),
        "dtype": args.dtype,
        "seconds_total": time.perf_counter() - start,
        "seconds_per_stage": calibrator.timings,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", default="1b", choices=list(GEOMETRIES))
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=4, help="calibration sequences per task")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hf_featcal_bench_llama"))
    parser.add_argument("--sweep", default=None, help="comma-separated numbers of experts, e.g. 1,4")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = os.path.join(args.workdir, f"{args.geometry}-{args.dtype}")
    os.makedirs(workdir, exist_ok=True)
    if args.measure:
        args.workdir = workdir
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    counts = [int(t) for t in args.sweep.split(",")] if args.sweep else [args.tasks]
    prepare(workdir, args.geometry, max(counts), getattr(torch, args.dtype))
    for tasks in counts:
        if tasks != max(counts):  # the merge of the first `tasks` experts
            prepare(workdir, args.geometry, tasks, getattr(torch, args.dtype))
    rows = []
    for tasks in counts:
        cmd = [sys.executable, __file__, "--measure", "--geometry", args.geometry, "--tasks", str(tasks),
               "--sequences", str(args.sequences), "--length", str(args.length), "--batch-size", str(args.batch_size),
               "--device", args.device, "--dtype", args.dtype, "--workdir", args.workdir]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
        print(json.dumps(rows[-1], indent=2), flush=True)
    if len(rows) > 1:
        print("\n| experts | seconds | peak RSS (GiB) | peak device (GiB) |\n|---:|---:|---:|---:|")
        for r in rows:
            device_mem = f"{r['peak_device_gib']:.2f}" if r["peak_device_gib"] is not None else "-"
            print(f"| {r['tasks']} | {r['seconds_total']:.1f} | {r['peak_rss_gib']:.2f} | {device_mem} |")


if __name__ == "__main__":
    main()
