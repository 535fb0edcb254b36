"""Stage *checkpoint*: after every block, persist what a resumed run needs, tied to a fingerprint
of the run (the folder format is `hf_featcal.checkpointing`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from ..checkpointing import CheckpointFolder, fingerprint
from ..experts import ModelSource
from .context import RunContext
from .drift import DriftLog
from .streams import Streams


@dataclass
class ResumedRun:
    """Where a checkpoint lets a run continue: after `finished_blocks` (1-based over every stack)."""

    finished_blocks: int
    streams: Streams
    drift: DriftLog | None


#: `FeatCalConfig` fields that only say where things are kept, never what is computed: a run may be
#: resumed with other values of them (streams loaded from a checkpoint keep their saved placement
#: until the next block parks its own)
PLACEMENT_ONLY_FIELDS = ("stream_placement", "restore_snapshot", "reuse_freed_cpu_memory")


def open_checkpoint(
    ctx: RunContext,
    path: str | os.PathLike,
    tasks: list[str],
    data_digest: str | None,
    tower_parameter_names: list[str],
    experts: Mapping[str, ModelSource],
    base: ModelSource | None,
) -> CheckpointFolder:
    """The run's checkpoint folder, fingerprinted by config (less `PLACEMENT_ONLY_FIELDS`), layer map,
    processes, tasks, data and the contents of every model."""
    digest = fingerprint(
        [
            ("config", {k: v for k, v in ctx.config.to_dict().items() if k not in PLACEMENT_ONLY_FIELDS}),
            ("layer_map", type(ctx.layer_map).__name__),
            ("processes", ctx.process.num_processes),
            ("tasks", tasks),
            ("data", data_digest),
            ("merged", ctx.parameters.named(tower_parameter_names)),
            *[(f"expert.{task}", source.digest(ctx.model)) for task, source in experts.items()],
            ("base", None if base is None else base.digest(ctx.model)),
        ]
    )
    return CheckpointFolder(path, digest, ctx.process.process_index, ctx.process.is_main_process, ctx.device)


def resume(ctx: RunContext, folder: CheckpointFolder) -> ResumedRun | None:
    """Load the folder's resume point (None for a fresh folder): once every block file has been
    checked, the finished blocks' parameters are written into the merged model one block at a time
    (at most one block's file pages are held: about one block's size, not the tower's), and the
    solve and guard logs so far replace `ctx.solve_log` and `ctx.guard_log`; the held-out streams
    (`FeatCalConfig.heldout_fraction`) come back with the others."""
    # meta (offloaded) parameters keep their shapes; tied aliases are names of their own
    shapes = {name: tuple(p.shape) for name, p in ctx.parameters.model.named_parameters(remove_duplicate=False)}
    point = folder.load(shapes)
    if point is None:
        return None
    for index in range(1, point.finished_blocks + 1):
        _write_parameters(ctx, folder.read_block(index))
    saved = point.streams
    ctx.solve_log = saved["solve_log"]
    ctx.guard_log = saved.get("guard_log", [])
    drift = None if saved["report"] is None else DriftLog(saved["report"])
    streams = Streams(saved["student"], saved["expert"], saved["given"], saved.get("heldout_student"),
                      saved.get("heldout_expert"), saved.get("heldout_given"))
    return ResumedRun(point.finished_blocks, streams, drift)


def _write_parameters(ctx: RunContext, parameters: dict[str, Tensor]) -> None:
    """Write one block's parameters; they (and the file mapping behind them) are released on return,
    as no reference outlives this call."""
    for name, value in parameters.items():
        ctx.parameters.write(name, value)


def save_block(
    ctx: RunContext,
    folder: CheckpointFolder,
    finished_blocks: int,
    parameter_names: list[str],
    streams: Streams,
    drift: DriftLog | None,
) -> None:
    """Commit one more finished block: its calibrated parameters and the streams entering the next."""
    folder.save(
        finished_blocks,
        ctx.parameters.named(parameter_names),
        {
            "student": streams.student, "expert": streams.expert, "given": streams.given,
            "report": None if drift is None else drift.tasks, "solve_log": ctx.solve_log,
            "heldout_student": streams.heldout_student, "heldout_expert": streams.heldout_expert,
            "heldout_given": streams.heldout_given, "guard_log": ctx.guard_log,
        },
        ctx.process.wait_for_everyone,
    )
