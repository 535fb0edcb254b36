"""One file per merge method: its function, and the `MergeMethod` it registers (parameters with their
defaults and ranges, paper defaults for the compare grid, paper reference, whether it needs
calibration data).

A method file imports torch and `hf_featcal.merging.engine` inside its functions, so that reading the
registry (``hf-featcal --help``, the recipe schema) loads no torch. Adding a method is a file here and
its name below (the order is the one the CLI, the schema and the compare grid list).
"""

from __future__ import annotations

import importlib

_METHOD_MODULES = (
    "average", "task_arithmetic", "ties", "dare", "dare_ties",  # data-free, element-wise
    "tsv_m", "iso_c", "iso_cts", "wudi",  # data-free, per matrix
    "regmean", "regmean_plusplus",  # calibration data
)

for _module in _METHOD_MODULES:
    importlib.import_module(f".{_module}", __name__)
