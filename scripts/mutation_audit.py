"""Mutation audit: does the suite notice a wrong FeatCal?

Each mutation is one textual change to a copy of `src/` (the working tree's), a deliberately wrong
implementation of one part of the method. For each, the chosen test files run against the mutated
copy (through PYTHONPATH, the checkout is left alone) and the failing tests are listed; a mutation
that no test catches is reported as SURVIVED and the script exits 1.

    python scripts/mutation_audit.py                       # every mutation, the default test files
    python scripts/mutation_audit.py rms_lambda_0 rms_centred --tests tests/test_t5.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name → (file under src/hf_featcal, text, replacement); the text must occur exactly once
MUTATIONS: dict[str, tuple[str, str, str]] = {
    "no_norm_solve": (
        "pipeline/solve.py",
        "    for (name, _), stats in norms.items():\n        module = block.get_submodule(name)",
        "    for (name, _), stats in list(norms.items())[:0]:\n        module = block.get_submodule(name)",
    ),
    "rms_lambda_0": (
        "pipeline/solve.py",
        'solve_scale_only_norm(stats.second_moment_sum, stats.gamma_target_sum, anchor_of(name, "weight"), lam, eps)',
        'solve_scale_only_norm(stats.second_moment_sum, stats.gamma_target_sum, anchor_of(name, "weight"), 0.0, eps)',
    ),
    "layer_norm_statistics_uncentred": (
        "statistics.py",
        "            return torch.native_layer_norm(x, (x.shape[-1],), None, None, self.norm_eps)[0]\n",
        "            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)\n",
    ),
    "drift_against_the_first_expert_batch": (
        "pipeline/drift.py",
        "        e_hidden = ctx.fetch(e).hidden\n",
        "        e_hidden = ctx.fetch(expert[0]).hidden\n",
    ),
    "drift_before_is_after": (
        "pipeline/drift.py",
        "[streams.given[task], streams.student[task]]",
        "[streams.student[task], streams.student[task]]",
    ),
    "rms_centred": (
        "statistics.py",
        "        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)",
        "        x = x - x.mean(-1, keepdim=True)\n"
        "        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)",
    ),
    "alpha_is_1": ("pipeline/accumulate.py", "    alpha = ctx.config.teacher_alpha\n", "    alpha = 1.0\n"),
    "alpha_is_0": ("pipeline/accumulate.py", "    alpha = ctx.config.teacher_alpha\n", "    alpha = 0.0\n"),
    "task_scale_1": (
        "statistics.py",
        "        s_i = task_scale(upper_gram_norm(gram) / total, self.epsilon)\n",
        "        s_i = 1.0\n",
    ),
    "task_sums_not_divided_by_their_weight": (
        "statistics.py",
        "        scale = s_i / total\n",
        "        scale = s_i\n",
    ),
    "later_tasks_cross_fold_dropped": (
        "statistics.py",
        "                self.rhs_sum[name].addmm_(cross, w_i.T)\n",
        "                pass\n",
    ),
    "later_tasks_direct_rhs_unscaled": (
        "statistics.py",
        "self.rhs_sum[name].add_(moments[index], alpha=scale)",
        "self.rhs_sum[name].add_(moments[index], alpha=s_i)",
    ),
    # exact-mode arithmetic (blocked Gram triangle, cross moment from the expert's inputs, blocked Cholesky)
    "gram_lower_blocks_not_mirrored": (
        "_kernels/gram.py", "            upper[c0:c1, r0:r1] = upper[r0:r1, c0:c1].T\n", "            pass\n",
    ),
    # buffers reused instead of reallocated (the Gram per task, the solve's work matrix, mapped checkpoint tensors)
    "gram_buffer_not_zeroed_between_tasks": (
        "statistics.py",
        "            for block in upper_blocks(self._gram):\n                block.zero_()\n",
        "            for block in upper_blocks(self._gram):\n                pass\n",
    ),
    "task_gram_folded_on_its_first_block_row_only": (
        "statistics.py",
        "zip(upper_blocks(self._gram_sum_upper), upper_blocks(gram), strict=True):",
        "list(zip(upper_blocks(self._gram_sum_upper), upper_blocks(gram), strict=True))[:1]:",
    ),
    # allocation-lean activations (bit-identical) and the snapshot's memory handover
    "lean_quick_gelu_constant": (
        "_kernels/activations.py", "    out = torch.mul(x, 1.702)\n", "    out = torch.mul(x, 1.7)\n",
    ),
    "lean_new_gelu_order": (
        "_kernels/activations.py", "    inner.mul_(0.044715).add_(x)", "    inner.add_(x).mul_(0.044715)",
    ),
    "lean_forward_with_gradients_on": (
        "_kernels/activations.py",
        "        return own(x) if torch.is_grad_enabled() else lean(x)\n",
        "        return lean(x)\n",
    ),
    "handover_of_a_parameter_sharing_memory": (
        "restore.py",
        " and owners.get(p.untyped_storage().data_ptr()) == 1",
        "",
    ),
    "handover_snapshot_is_the_live_parameter": (
        "restore.py",
        "                tensor.data = original.clone()\n",
        "                pass\n",
    ),
    "gram_sum_not_remirrored_after_a_task": ("statistics.py", "        self._gram_sum = None\n", "        pass\n"),
    "solve_factors_the_gram_in_place": (
        "solver.py",
        "    system = shifted(lhs, shift, work)\n    factor, info = cholesky(system, out=system)\n    if info == 0:",
        "    system = shifted(lhs, shift, lhs)\n    factor, info = cholesky(system, out=system)\n    if info == 0:",
    ),
    "damped_retry_from_the_failed_work_matrix": (
        "solver.py",
        "        system = shifted(lhs, shift, work)\n        system.diagonal().add_(damping)\n",
        "        system = work if work is not None else shifted(lhs, shift)\n        system.diagonal().add_(damping)\n",
    ),
    "checkpoint_block_keeps_the_merged_tensors": (
        "experts.py",
        "                    memo[id(tensor)] = nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, "
        "nn.Parameter) else value\n",
        "                    pass\n",
    ),
    "gram_norm_of_upper_only": (
        "_kernels/gram.py", "            total += 2.0 * float(rows.dot(rows))\n",
        "            total += float(rows.dot(rows))\n",
    ),
    "cross_moment_without_student_part": (
        "statistics.py",
        "                    cross.lerp_(moments[0], alpha)\n",
        "                    cross = moments[0]\n",
    ),
    "teacher_mean_is_student_mean": (
        "statistics.py",
        "        mu_t = torch.lerp(mu_s, mu_e, alpha)\n",
        "        mu_t = mu_s\n",
    ),
    "cholesky_without_trailing_update": (
        "solver.py",
        "            work[row0:row1, stop:row1].addmm_(rows, panel[: row1 - stop].T, alpha=-1.0)\n",
        "            pass\n",
    ),
    "objective_decrease_from_diagonal_blocks_only": (
        "solver.py",
        "        torch.mm(a[:, start:], lower[start:, start:stop], out=out[:, start:stop])\n",
        "        torch.mm(a[:, start:stop], lower[start:stop, start:stop], out=out[:, start:stop])\n",
    ),
    "anchor_is_merged": (
        "pipeline/solve.py",
        "        return anchor(merged, base, rho)\n",
        "        return anchor(merged, None, rho)\n",
    ),
    "pooled_weights_off": (
        "pipeline/accumulate.py",
        "    if not weighted:\n        return weights\n",
        "    if True:\n        return weights\n",
    ),
    "pooled_weights_on_key_value": (
        "pipeline/plan.py",
        "        weighted = pooled is not None and spec.name not in lm.key_value_modules\n",
        "        weighted = pooled is not None\n",
    ),
    "mixed_gemm_beta_ignored": (
        "_kernels/mkl_products.py",
        "a.data_ptr(), lda, b.data_ptr(), ldb, float(beta),",
        "a.data_ptr(), lda, b.data_ptr(), ldb, 1.0,",
    ),
    "mixed_gemm_transpose_flag": (
        "_kernels/mkl_products.py",
        "        return _TRANSPOSE, matrix.stride(1)",
        "        return _NO_TRANSPOSE, matrix.stride(1)",
    ),
    "fast_products_rounded_on_cpu": (
        "_kernels/gram.py",
        "        if addmm_low_(out, a, b):\n            return out\n",
        "        if False:\n            return out\n",
    ),
    "outputs_rhs_no_bias_correction": (
        "statistics.py",
        "            if alpha != 0.0 and expert.bias is not None:",
        "            if False:",
    ),
    "outputs_rhs_student_weight": (
        "statistics.py",
        "rhs = symmetric_upper_product(self._gram, w_i.T).mul_(1.0 - alpha)",
        "rhs = symmetric_upper_product(self._gram, w_i.T).mul_(alpha)",
    ),
    "outputs_captured_are_inputs": (
        "hooks.py",
        "                store[_name] = output",
        "                store[_name] = args[0]",
    ),
    "syrk_diagonal_blocks_not_mirrored": (
        "statistics.py",
        "        mirror_diagonal_blocks_(self._gram)  # (syrk left their lower halves out)\n",
        "",
    ),
    "syrk_diagonal_blocks_mirrored_wrong": (
        "_kernels/gram.py",
        "block.copy_(block.triu().add_(block.triu(1).mT))",
        "block.copy_(block.triu().add_(block.tril(-1)))",
    ),
    "syrk_other_triangle": ("_kernels/mkl_products.py", 'b"L", b"N" if transpose', 'b"U", b"N" if transpose'),
    "gram_norm_off_diagonal_once": ("_kernels/gram.py", "total += 2.0 * float(rows.dot(rows))",
                                    "total += float(rows.dot(rows))"),
    "gram_norm_float32_whole_matrix": (
        "_kernels/gram.py",
        "    return total**0.5\n",
        "    return float(torch.linalg.matrix_norm(symmetric_from_upper(upper)))\n",
    ),
    "cpu_memory_not_wired": (
        "calibrator.py",
        'reuse_freed_memory(self.config.reuse_freed_cpu_memory and self.device.type == "cpu")',
        "reuse_freed_memory(False)",
    ),
    "cpu_memory_run_thresholds_unset": (
        "_kernels/memory.py", "        libc.mallopt(_M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)\n", "",
    ),
    "cpu_memory_nothing_handed_back": ("_kernels/memory.py", "            libc.malloc_trim(0)\n", "            pass\n"),
    "cpu_memory_run_thresholds_kept_after": (
        "_kernels/memory.py", "AFTER_MMAP_THRESHOLD = 32 << 20", "AFTER_MMAP_THRESHOLD = 64 << 20",
    ),
    "cpu_memory_inner_exit_resets": ("_kernels/memory.py", "        if _depth == 0:\n            libc.mallopt(_M_TRIM",
                                     "        if True:\n            libc.mallopt(_M_TRIM"),
    "drift_without_padding_mask": ("pipeline/drift.py", "totals[i] += (distances * mask).sum()",
                                   "totals[i] += distances.sum()"),
}

DEFAULT_TESTS = ["tests/test_reference_blockwise.py", "tests/test_t5.py", "tests/test_llm.py",
                 "tests/test_encoders.py", "tests/test_reference_agreement.py", "tests/test_statistics_arithmetic.py",
                 "tests/test_lazy_experts.py", "tests/test_activations.py", "tests/test_restore_snapshot.py",
                 "tests/test_mkl_products.py", "tests/test_fast_mode.py",
                 "tests/test_expert_outputs_rhs.py", "tests/test_cpu_memory.py"]


def run_mutation(name: str, tests: list[str], workers: int) -> list[str]:
    """The tests that fail with mutation `name` applied (an empty list: it survived)."""
    filename, text, replacement = MUTATIONS[name]
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as scratch:
        shutil.copytree(os.path.join(ROOT, "src"), os.path.join(scratch, "src"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        path = os.path.join(scratch, "src", "hf_featcal", filename)
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        if source.count(text) != 1:
            raise SystemExit(f"{name}: the text to mutate occurs {source.count(text)} times in {filename} "
                             "(the code changed: update MUTATIONS)")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(source.replace(text, replacement))
        env = dict(os.environ, PYTHONPATH=os.path.join(scratch, "src"))
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
        if workers > 1:
            command += ["-n", str(workers)]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    return [line.split(" ")[1] for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutations", nargs="*", help=f"default: all of {', '.join(MUTATIONS)}")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    parser.add_argument("-n", "--workers", type=int, default=2)
    args = parser.parse_args()
    unknown = sorted(set(args.mutations) - set(MUTATIONS))
    if unknown:
        parser.error(f"unknown mutations {unknown}; known: {', '.join(MUTATIONS)}")
    survived = []
    for name in args.mutations or list(MUTATIONS):
        failed = run_mutation(name, args.tests, args.workers)
        print(f"{name}: " + (f"caught by {len(failed)}: " + ", ".join(f.split('::', 1)[-1] for f in failed)
                             if failed else "SURVIVED"), flush=True)
        if not failed:
            survived.append(name)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
