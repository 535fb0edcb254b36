"""The module's earlier name, documented before it was renamed: see `hf_featcal.hparam_search`."""

from .hparam_search import CRITERIA, DEFAULT_GRID, TuningResult, no_harm_score, train_holdout_split, tune_featcal

__all__ = ["CRITERIA", "DEFAULT_GRID", "TuningResult", "no_harm_score", "train_holdout_split", "tune_featcal"]
