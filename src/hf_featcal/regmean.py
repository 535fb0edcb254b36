"""The documented path of RegMean, which lives in `hf_featcal.merging.methods.regmean`."""

from .merging.methods.regmean import expert_grams, regmean_merging  # noqa: F401
