"""GLUE metric for text-to-text (FLAN-T5 style) evaluation, as an ``evaluate`` module.

Load it offline from its folder or file, with the GLUE task as the config name::

    import evaluate
    metric = evaluate.load("/path/to/hf_featcal/evaluation/glue_metric", "cola")
    metric.compute(predictions=[1, None, 0], references=[1, 0, 0])

or simply with :func:`hf_featcal.evaluation.load_glue_metric`. This file is loaded by
``evaluate`` as a standalone script, so it must not import ``hf_featcal``.
"""

import math

import datasets
import evaluate
import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={International Conference on Learning Representations},
  year={2019}
}
"""

_DESCRIPTION = """\
GLUE scores for generated (text-to-text) answers that have already been parsed into
labels. Unlike the standard GLUE metric, predictions may be unparsable (None, or an
out-of-range label / NaN), and are scored as follows:

- accuracy (cola, mnli, mrpc, qnli, qqp, rte, sst2): an unparsable prediction is wrong;
- f1 (mrpc, qqp): an unparsable prediction is replaced by the opposite of its reference
  label, so it always counts as an error (T5's ``f1_score_with_invalid`` convention);
- matthews_correlation (cola): unparsable predictions form their own class (-1), as
  when sklearn's ``matthews_corrcoef`` is applied to T5's invalid label;
- spearman / pearson (stsb): an unparsable prediction is replaced by 0.0 (FusionBench's
  FLAN-T5 evaluation convention). A correlation that is undefined (constant input) is
  reported as 0.0.

The headline score is ``accuracy`` for the classification tasks and ``spearman`` for stsb.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: parsed predictions. Classification tasks: int labels, with None (or any
        value outside the task's label set, e.g. -1) for an unparsable answer.
        stsb: float scores, with None or NaN for an unparsable answer.
    references: gold labels (ints; floats for stsb).
Returns:
    dict of floats: cola: accuracy, matthews_correlation; mnli, qnli, rte, sst2:
    accuracy; mrpc, qqp: accuracy, f1; stsb: spearman, pearson.
Examples:
    >>> metric = evaluate.load("glue_metric", "mrpc")  # doctest: +SKIP
    >>> metric.compute(predictions=[1, None], references=[1, 1])  # doctest: +SKIP
    {'accuracy': 0.5, 'f1': 0.666...}
"""

# Number of classes per classification task (labels are 0..n-1).
_NUM_CLASSES = {"cola": 2, "mnli": 3, "mrpc": 2, "qnli": 2, "qqp": 2, "rte": 2, "sst2": 2}
_TASKS = tuple(sorted([*_NUM_CLASSES, "stsb"]))


def _as_label_array(values, num_classes):
    """Integer array with every unparsable/out-of-range entry mapped to -1."""
    out = np.full(len(values), -1, dtype=np.int64)
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        iv = int(v)
        if iv == v and 0 <= iv < num_classes:
            out[i] = iv
    return out


def _correlation(fn, x, y):
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return 0.0  # undefined for constant input
    value = float(fn(x, y)[0])
    return 0.0 if math.isnan(value) else value


class GlueMetric(evaluate.Metric):
    """Text-to-text GLUE metric; the config name is the GLUE task."""

    def _info(self):
        if self.config_name not in _TASKS:
            raise ValueError(
                f"config_name (the GLUE task) must be one of {list(_TASKS)}, got {self.config_name!r}"
            )
        dtype = "float64" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)}
            ),
            reference_urls=["https://gluebenchmark.com/"],
        )

    def _compute(self, predictions, references):
        task = self.config_name
        if len(predictions) == 0:
            raise ValueError("predictions must not be empty")
        if task == "stsb":
            refs = np.asarray(references, dtype=np.float64)
            if np.isnan(refs).any():
                raise ValueError("stsb references must be finite floats")
            preds = np.array(
                [0.0 if p is None or not math.isfinite(p) else float(p) for p in predictions],
                dtype=np.float64,
            )
            return {
                "spearman": _correlation(spearmanr, preds, refs),
                "pearson": _correlation(pearsonr, preds, refs),
            }

        num_classes = _NUM_CLASSES[task]
        refs = _as_label_array(references, num_classes)
        if (refs < 0).any():
            raise ValueError(
                f"references for {task!r} must be labels in 0..{num_classes - 1} "
                "(unlabelled GLUE test splits cannot be scored)"
            )
        preds = _as_label_array(predictions, num_classes)
        result = {"accuracy": float(accuracy_score(refs, preds))}
        if task == "cola":
            result["matthews_correlation"] = float(matthews_corrcoef(refs, preds))
        if task in ("mrpc", "qqp"):
            flipped = np.where(preds < 0, 1 - refs, preds)
            result["f1"] = float(f1_score(refs, flipped, pos_label=1, average="binary", zero_division=0.0))
        return result
