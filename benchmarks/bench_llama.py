"""Benchmark: FeatCal on a Llama-geometry decoder (random init, synthetic task vectors, experts on disk).

Shows that a multi-billion-parameter merge fits one machine: peak memory ≈ merged model + its
snapshot + one block of the base and of one expert + the streams, whatever the number of experts.
Prints per run (JSON, then a table) seconds per stage, the arithmetic count per stage (`flop_count`),
the achieved fraction of this machine's measured matmul peak for the dtype each stage runs in, peak
RSS (this process's `VmHWM`) and peak device memory (GPU).

    python benchmarks/bench_llama.py --geometry 1b --sweep 1,4 --sequences 4 --length 128      # CPU memory
    python benchmarks/bench_llama.py --geometry 3b --device cuda --dtype bfloat16 --tasks 4 \\
        --sequences 64 --length 512                                                     # GPU variant
    python benchmarks/bench_llama.py --geometry 1b --device cuda --forward-dtype bfloat16 \\
        --restore-snapshot disk --tasks 4 --sequences 64 --length 512                   # fast mode, snapshot on disk
    python benchmarks/bench_llama.py --geometry tiny --tasks 2 --sequences 4 --length 64    # try the script
    python benchmarks/bench_llama.py --check-flops      # `flop_count` against torch's FlopCounterMode, per stage

Writing the random-init checkpoints takes disk: about (tasks + 2) × model size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported from elsewhere

from bench_common import (
    low_products_in_use,
    lower_triangular_fraction,
    matmul_throughput,
    peak_rss_gib,
    rate_report,
    stage_dtypes,
    stage_table,
    syrk_in_use,
    triangle_fraction,
)

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
    # `--check-flops`: every input width blocked into a Gram triangle (≥ 512) and below the blocked
    # Cholesky (< 1024), whose CPU panels FlopCounterMode would partly see
    "check": dict(hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
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


def statistics_groups(geometry: dict) -> list[tuple[int, list[int]]]:
    """(input width, output width of each module) of every statistics group of one decoder block, as
    the Llama layer map groups them: q/k/v share the hidden input, o_proj reads the heads, gate/up
    share the hidden input, down_proj reads the intermediate features."""
    d, ff = geometry["hidden_size"], geometry["intermediate_size"]
    heads, kv_heads = geometry["num_attention_heads"], geometry["num_key_value_heads"]
    head_dim = geometry.get("head_dim") or d // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return [(d, [q, kv, kv]), (q, [d]), (d, [ff, ff]), (ff, [d])]


def flop_count(
    geometry: dict,
    tasks: int,
    sequences: int,
    length: int,
    batch_size: int,
    layers: int | None = None,
    counted_tokens: int | None = None,
    teacher_alpha: float = 0.25,
    report_drift: bool = True,
    causal: bool = True,
    products_only: bool = False,
    exact: bool = True,
    syrk: bool = False,
) -> dict[str, float]:
    """Arithmetic (2 × multiply-adds) of one FeatCal run on a Llama geometry, per timed stage, as the
    library does it (RMS norms, rotary embeddings, element-wise work and mat-vecs left out).

    `counted_tokens`: non-padding positions per task (default: all `sequences × length`); only they
    enter the statistics, every position is forwarded. `causal`: attention counted as the causal half
    (position p against p + 1 keys: 4·(p+1)·q_width per token for QKᵀ and PV), the work a causal
    kernel must do; False: the full L × L products (what torch's FlopCounterMode counts for SDPA).
    `products_only`: solving counted without the Cholesky factorisations and triangular solves
    (FlopCounterMode sees matrix products only; true for widths below the CPU-blocked Cholesky).
    `exact`: exact mode, where a down projection's right-hand side comes from the expert's outputs
    once that pays (`hf_featcal.statistics.outputs_rhs_pays`: more tokens per task than n at 0 < α < 1).

    Per block and stream (M positions): the student (merged) pass stops once mlp.down_proj's input
    is captured — except the first batch of every block (the stopping module is not known yet) and
    block 0 with the drift report (the student is also the merged-as-given stream there); the expert
    runs the whole block. Statistics per group of input width n: the Gram's block upper triangle
    (`triangle_fraction(n, syrk)` of 2·M·n²: with `syrk`, `syrk_in_use`, every Gram here has unit
    token weights and is MKL's upper triangle), the cross moment 2·M·n² (α ≠ 0) and at task end the fold
    X_i W_iᵀ (2·n²·outputs); a group whose outputs are narrower than n (down_proj) accumulates its
    right-hand side directly (2·M·n·out for x_t W_iᵀ and as much for x_sᵀ y). Solving per group: two
    Cholesky factorisations (n³/3 each: the singularity check, when the tokens are at least n, and
    the solve), the triangular solves (2·n²·outputs) and each module's objective decrease
    (`lower_triangular_fraction(n)` of 2·out·n²).
    """
    layers = geometry["num_hidden_layers"] if layers is None else layers
    d, ff = geometry["hidden_size"], geometry["intermediate_size"]
    groups = statistics_groups(geometry)
    q_width = groups[1][0]
    positions = tasks * sequences * length  # per stream
    rows = tasks * (sequences * length if counted_tokens is None else counted_tokens)  # statistics rows
    per_sequence_keys = length * (length + 1) / 2 if causal else length * length
    attention = tasks * sequences * 4 * q_width * per_sequence_keys
    linears = 2 * sum(n * sum(outs) for n, outs in groups)  # per position
    down = 2 * ff * d
    block_forward = positions * linears + attention
    merged_until_down = block_forward - positions * down
    first_batch_rest = min(batch_size, sequences) * length * down
    forwards = layers * block_forward + (layers - 1) * (merged_until_down + first_batch_rest)
    forwards += block_forward if report_drift else merged_until_down + first_batch_rest
    from hf_featcal.statistics import outputs_rhs_pays

    statistics = solving = 0.0
    for n, outs in groups:
        out = sum(outs)
        statistics += triangle_fraction(n, syrk) * 2 * rows * n * n
        student_term, expert_term = teacher_alpha != 1.0, teacher_alpha != 0.0
        if out < n and exact and outputs_rhs_pays(rows // tasks, n, teacher_alpha):
            # from the expert's outputs: x_sᵀ·y_e per token, the Gram times W_iᵀ once per task
            statistics += expert_term * 2 * rows * n * out + student_term * tasks * 2 * n * n * out
        elif out < n:  # direct right-hand side
            statistics += 2 * (2 * rows * n * out)
        elif teacher_alpha != 0.0:
            statistics += 2 * rows * n * n + tasks * 2 * n * n * out
        else:
            statistics += tasks * 2 * n * n * out
        decreases = sum(lower_triangular_fraction(n) * 2 * o * n * n for o in outs)
        factorisations = (2 if rows >= n else 1) * n**3 / 3 + 2 * n * n * out
        solving += decreases + (0.0 if products_only else factorisations)
    return {
        "block forwards": forwards,
        "statistics": layers * statistics,
        "solving": layers * solving,
        "propagating": layers * block_forward,
        "drift (merged-as-given stream)": (layers - 1) * block_forward if report_drift else 0.0,
    }


def _calibrator(args: argparse.Namespace, merged: torch.nn.Module, device: torch.device):
    from hf_featcal import FeatCalCalibrator, FeatCalConfig

    experts = {f"task{i}": os.path.join(args.workdir, f"expert-{i}") for i in range(args.tasks)}
    vocab = GEOMETRIES[args.geometry]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    data = {
        task: [{"input_ids": torch.randint(0, vocab, (min(args.batch_size, args.sequences - s), args.length),
                                           generator=gen),
                "attention_mask": torch.ones(min(args.batch_size, args.sequences - s), args.length, dtype=torch.long)}
               for s in range(0, args.sequences, args.batch_size)]
        for task in experts
    }
    config = FeatCalConfig(num_samples_per_task=args.sequences, forward_dtype=_forward_dtype(args),
                           restore_snapshot=args.restore_snapshot)
    return FeatCalCalibrator(merged, os.path.join(args.workdir, "base"), experts, data, config, device=device,
                             show_progress=False)


def _forward_dtype(args: argparse.Namespace) -> str | None:
    return None if args.forward_dtype == "none" else args.forward_dtype


def measure(args: argparse.Namespace) -> dict:
    from transformers import LlamaForCausalLM

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    merged = LlamaForCausalLM.from_pretrained(os.path.join(args.workdir, f"merged-{args.tasks}"), dtype=dtype).eval()
    calibrator = _calibrator(args, merged, device)
    calibrator.profile = True
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    calibrator.calibrate()
    total = time.perf_counter() - start
    # memory first: the throughput probe below allocates its own matrices
    peak_rss = peak_rss_gib()
    peak_device = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    forward_dtype = _forward_dtype(args)
    dtypes = stage_dtypes(args.dtype, forward_dtype, low_products_in_use(device, forward_dtype))
    peaks = {name: matmul_throughput(device, getattr(torch, name)) for name in sorted(set(dtypes.values()))}
    config = calibrator.config
    flops = flop_count(GEOMETRIES[args.geometry], args.tasks, args.sequences, args.length, args.batch_size,
                       teacher_alpha=config.teacher_alpha, report_drift=config.report_drift,
                       exact=forward_dtype is None, syrk=syrk_in_use(device, forward_dtype))
    return {
        "geometry": args.geometry,
        "parameters_billion": sum(p.numel() for p in merged.parameters()) / 1e9,
        "tasks": args.tasks,
        "sequences_per_task": args.sequences,
        "tokens_per_sequence": args.length,
        "device": str(device),
        "dtype": args.dtype,
        "forward_dtype": forward_dtype,
        "restore_snapshot": args.restore_snapshot,
        "seconds_total": total,
        "seconds_per_stage": calibrator.timings,
        "peak_rss_gib": peak_rss,
        "peak_device_gib": peak_device,
        **rate_report(flops, calibrator.timings, dtypes, peaks),
    }


def _table_title(result: dict) -> str:
    return (
        f"llama {result['geometry']} ({result['parameters_billion']:.3f} B) · {result['tasks']} tasks × "
        f"{result['sequences_per_task']} sequences × {result['tokens_per_sequence']} tokens · {result['device']} · "
        f"model {result['dtype']} · forward dtype {result['forward_dtype'] or 'none (exact)'} · "
        f"snapshot {result['restore_snapshot']}"
    )


def check_flops(args: argparse.Namespace) -> None:
    """One `calibrate()` on the `check` geometry with torch's FlopCounterMode opened around each timed
    stage; prints its count per stage next to `flop_count`'s (full attention, products only: what
    FlopCounterMode sees). torch's counter knows neither the CPU SDPA kernel nor the in-place
    `addmm_` the accumulators add each later batch with: they get torch's SDPA formula and 2·m·k·n.
    MKL's syrk is called past torch, unseen by the counter: the Grams take the blocked products here."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
    from transformers import LlamaForCausalLM

    from hf_featcal.pipeline.context import RunContext

    prepare(args.workdir, args.geometry, args.tasks, torch.float32)
    merged = LlamaForCausalLM.from_pretrained(os.path.join(args.workdir, f"merged-{args.tasks}"),
                                              dtype=torch.float32).eval()
    calibrator = _calibrator(args, merged, torch.device("cpu"))
    aten = torch.ops.aten
    import hf_featcal.statistics as statistics

    statistics.syrk_upper_ = lambda *args, **kwargs: False  # (this process only: it measures the count)

    def full_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:  # shapes: FlopCounterMode wraps it
        return sdpa_flop_count(query, key, value)

    def inplace_addmm(self_, a, b, *args, out_shape=None, **kwargs) -> int:  # the accumulators' `addmm_`
        return 2 * a[0] * a[1] * b[1]

    missing = {aten._scaled_dot_product_flash_attention_for_cpu: full_attention, aten.addmm_: inplace_addmm}
    counted: dict[str, int] = {}
    timed = RunContext.timed

    @contextlib.contextmanager
    def counting(self, stage: str):
        with timed(self, stage), FlopCounterMode(display=False, custom_mapping=missing) as counter:
            yield
        counted[stage] = counted.get(stage, 0) + counter.get_total_flops()

    RunContext.timed = counting
    try:
        calibrator.calibrate()
    finally:
        RunContext.timed = timed
    config = calibrator.config
    model = flop_count(GEOMETRIES[args.geometry], args.tasks, args.sequences, args.length, args.batch_size,
                       teacher_alpha=config.teacher_alpha, report_drift=config.report_drift, causal=False,
                       products_only=True, exact=config.forward_dtype is None)
    print(
        f"geometry {args.geometry} · {args.tasks} tasks × {args.sequences} sequences × {args.length} tokens · batches "
        f"of {args.batch_size}"
    )
    print("| stage | flop_count (GFLOP) | FlopCounterMode (GFLOP) | ratio |\n|---|---:|---:|---:|")
    for stage in dict.fromkeys([*model, *counted]):
        ours, torchs = model.get(stage, 0.0), counted.get(stage, 0)
        ratio = f"{ours / torchs:.6f}" if torchs else "-"
        print(f"| {stage} | {ours / 1e9:.4f} | {torchs / 1e9:.4f} | {ratio} |")
    ours, torchs = sum(model.values()), sum(counted.values())
    print(f"| total | {ours / 1e9:.4f} | {torchs / 1e9:.4f} | {ours / torchs:.6f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", default="1b", choices=list(GEOMETRIES))
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=4, help="calibration sequences per task")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--forward-dtype", default="none", choices=["none", "bfloat16", "float16"],
                        help="FeatCalConfig.forward_dtype: none (exact mode) or the fast mode's autocast dtype")
    parser.add_argument("--restore-snapshot", default="memory", choices=["memory", "disk"],
                        help="FeatCalConfig.restore_snapshot: where the merged model's restore copy is kept")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hf_featcal_bench_llama"))
    parser.add_argument("--sweep", default=None, help="comma-separated numbers of experts, e.g. 1,4")
    parser.add_argument("--output", default=None, help="also write the results (a JSON list) to this file")
    parser.add_argument("--check-flops", action="store_true",
                        help="compare flop_count with torch's FlopCounterMode on one in-process CPU run "
                             "(default geometry then: check, 2 tasks × 4 sequences × 64 tokens)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    if "--check-flops" in argv:  # its own defaults, unless given
        defaults = {"--geometry": "check", "--tasks": "2", "--sequences": "4", "--length": "64", "--batch-size": "2"}
        given = {a.split("=")[0] for a in argv}
        argv = [*(x for k, v in defaults.items() if k not in given for x in (k, v)), *argv]
    args = parser.parse_args(argv)
    workdir = os.path.join(args.workdir, f"{args.geometry}-{args.dtype}")
    os.makedirs(workdir, exist_ok=True)
    if args.check_flops:
        args.workdir = workdir
        check_flops(args)
        return
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
               "--device", args.device, "--dtype", args.dtype, "--forward-dtype", args.forward_dtype,
               "--restore-snapshot", args.restore_snapshot, "--workdir", args.workdir]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stdout + run.stderr)
            raise SystemExit(f"the measured run ({tasks} experts) failed with exit status {run.returncode}")
        rows.append(json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:]))
        print(json.dumps(rows[-1], indent=2), flush=True)
        print("\n" + stage_table(rows[-1], _table_title(rows[-1])) + "\n", flush=True)
        if args.output:
            with open(args.output, "w", encoding="utf-8") as handle:
                json.dump(rows, handle, indent=2)
    if len(rows) > 1:
        print(
            "\n| experts | seconds | peak RSS (GiB) | peak device (GiB) | fraction of matmul peak "
            "|\n|---:|---:|---:|---:|---:|"
        )
        for r in rows:
            device_mem = f"{r['peak_device_gib']:.2f}" if r["peak_device_gib"] is not None else "-"
            fraction = r["block_work_fraction_of_matmul_peak"]
            print(f"| {r['tasks']} | {r['seconds_total']:.1f} | {r['peak_rss_gib']:.2f} | {device_mem} | "
                  f"{'-' if fraction is None else format(fraction, '.2f')} |")


if __name__ == "__main__":
    main()
