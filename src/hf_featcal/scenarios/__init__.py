"""Offline merging scenarios: small but real base/expert models built from a seed, no download.

- :mod:`hf_featcal.scenarios.digits`: the digits / tiny-CLIP-vision scenario behind ``hf-featcal demo``
  (``build_digits_scenario``).
- :mod:`hf_featcal.scenarios.base`: what every scenario shares: the `MergingScenario` base class and
  the on-disk build cache (``build_or_load``).

The test suite's text scenarios (tiny T5 and Llama) live in ``tests/scenarios/`` on the same base.
"""
