"""Start-up time of the package: wall time of ``python -c "import hf_featcal"`` and ``hf-featcal --help``.

Each command runs in a fresh subprocess (nothing is imported in this process), ``--repeat`` times
(default 5); the median, minimum and maximum wall times are printed. The issue's target on a 2-core
machine is ≤ 1.5 s for both.

    python benchmarks/bench_import.py [--repeat 5] [--modules]

``--modules`` also lists which heavy libraries ``import hf_featcal`` loaded (they should load only
when a command needs them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

HEAVY_MODULES = ("torch", "transformers", "datasets", "torchvision", "scipy", "pandas", "accelerate", "safetensors")


def _cli_command() -> list[str]:
    """``hf-featcal`` next to this interpreter (the venv's console script), else ``python -m hf_featcal.cli``."""
    script = os.path.join(os.path.dirname(sys.executable), "hf-featcal")
    if os.path.isfile(script):
        return [script, "--help"]
    found = shutil.which("hf-featcal")
    if found:
        return [found, "--help"]
    return [sys.executable, "-m", "hf_featcal.cli", "--help"]


def time_command(command: list[str], repeat: int) -> list[float]:
    """Wall seconds of `repeat` fresh runs of `command` (each must exit 0)."""
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        seconds.append(time.perf_counter() - start)
    return seconds


def loaded_heavy_modules() -> list[str]:
    """The heavy libraries that ``import hf_featcal`` leaves in ``sys.modules`` (fresh interpreter)."""
    probe = f"import sys, hf_featcal; print(' '.join(m for m in {HEAVY_MODULES!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return out.split()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument("--modules", action="store_true", help="also list the heavy libraries the import loads")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")

    commands = {
        "import hf_featcal": [sys.executable, "-c", "import hf_featcal"],
        "hf-featcal --help": _cli_command(),
    }
    medians = {}
    for name, command in commands.items():
        seconds = time_command(command, args.repeat)
        medians[name] = statistics.median(seconds)
        print(f"{name:<20} median {medians[name]:6.2f} s  (min {min(seconds):.2f}, max {max(seconds):.2f}, "
              f"{args.repeat} fresh runs)")
    if args.modules:
        heavy = loaded_heavy_modules()
        print("heavy modules after `import hf_featcal`: " + (", ".join(heavy) if heavy else "none"))
    return medians


if __name__ == "__main__":
    main()
