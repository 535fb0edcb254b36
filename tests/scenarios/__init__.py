"""The test suite's offline text scenarios, on the shared base of `hf_featcal.scenarios.base`:

- :mod:`scenarios.text`: tiny T5, text-to-text digit tasks, exact match (the FLAN-T5 / GLUE setting);
- :mod:`scenarios.causal`: tiny Llama, the same tasks as prompt-then-answer text (the LLM setting).

Used by the tests (``tests/`` is on ``sys.path`` under pytest) and by ``benchmarks/scenario_spread.py``.
"""
