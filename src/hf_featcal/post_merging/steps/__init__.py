"""One file per post-merging step: its ``apply`` function, and the `PostMergingStep` it registers
(parameters with their paper defaults and ranges, reference, whether it needs calibration data,
whether its result carries per-task modules).

A step file imports torch and what it runs inside ``apply``, so that reading the registry
(``hf-featcal --help``, the recipe schema) loads no torch. Adding a step is a file here, its name below
(the order the CLI, the schema and the compare grid list), its row in docs/merge-methods.md and its test.
"""

from __future__ import annotations

import importlib

_STEP_MODULES = ("none", "featcal", "featcal_module", "featcal_guarded", "svc", "surgery", "prob_surgery")

for _module in _STEP_MODULES:
    importlib.import_module(f".{_module}", __name__)
