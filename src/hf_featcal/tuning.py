"""The module's earlier name, documented before it was renamed: see `hf_featcal.hparam_search`."""

from .hparam_search import DEFAULT_GRID, TuningResult, train_holdout_split, tune_featcal

__all__ = ["DEFAULT_GRID", "TuningResult", "train_holdout_split", "tune_featcal"]
