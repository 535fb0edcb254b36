"""What every evaluation's results share (`EvaluationResults`: tasks, headline score per task, their
mean, a markdown table) and the one table of several models' scores (`scores_table`) that the recipes
and the CLI print."""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__ = ["EvaluationResults", "scores_table"]


class EvaluationResults:
    """Base of one evaluation's results. A subclass gives `scores` (task → headline score in [0, 1],
    in evaluation order) and the columns of its markdown table (`_columns`, `_cells`)."""

    #: Header and alignment (``"---"``, ``"---:"``) of the table columns after ``Task``.
    _columns: tuple[tuple[str, str], ...] = ()
    #: The column (index into `_columns`) that the ``Average`` row fills.
    _average_column: int = 0

    @property
    def scores(self) -> dict[str, float]:
        """Headline score per task, in evaluation order."""
        raise NotImplementedError

    @property
    def tasks(self) -> list[str]:
        """Evaluated tasks, in evaluation order."""
        return list(self.scores)

    @property
    def average(self) -> float:
        """Plain (unweighted) mean of the headline scores over tasks."""
        values = list(self.scores.values())
        return float(sum(values) / len(values)) if values else float("nan")

    def _task_name(self, task: str) -> str:
        """The name `task` (or an alias of it) is stored under."""
        return task

    def __getitem__(self, task: str) -> float:
        return self.scores[self._task_name(task)]

    def _cells(self, task: str, fmt: Callable[[float], str]) -> list[str]:
        """The cells of `task`'s row after its name."""
        raise NotImplementedError

    @staticmethod
    def _formatter(percent: bool, digits: int) -> Callable[[float], str]:
        scale = 100.0 if percent else 1.0
        return lambda x: f"{x * scale:.{digits}f}"

    def to_markdown(self, percent: bool = True, digits: int = 2) -> str:
        """Markdown table: one row per task, then the average."""
        fmt = self._formatter(percent, digits)
        lines = ["| Task | " + " | ".join(name for name, _ in self._columns) + " |",
                 "|---|" + "".join(f"{align}|" for _, align in self._columns)]
        lines += [f"| {task} | " + " | ".join(self._cells(task, fmt)) + " |" for task in self.tasks]
        average = ["" for _ in self._columns]
        average[self._average_column] = fmt(self.average)
        lines.append("| **Average** |" + "|".join(f" {cell} " if cell else " " for cell in average) + "|")
        return "\n".join(lines)


def scores_table(rows: Mapping[str, Mapping[str, float]], tasks: list[str], title: str = "model",
                 percent: bool = True) -> str:
    """A markdown table, one row per model, one column per task plus the mean (in % when `percent`, else
    the scores as they are, with two decimals)."""
    scale, digits = (100.0, 1) if percent else (1.0, 2)
    header = f"| {title} | " + " | ".join(tasks) + " | mean |"
    lines = [header, "|---|" + "---:|" * (len(tasks) + 1)]
    for name, scores in rows.items():
        cells = [f"{scale * scores[t]:.{digits}f}" if t in scores else "–" for t in tasks]
        values = [scores[t] for t in tasks if t in scores]
        mean = f"{scale * sum(values) / len(values):.{digits}f}" if values else "–"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)
