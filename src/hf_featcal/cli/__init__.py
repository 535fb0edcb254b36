"""The ``hf-featcal`` command line: merge, calibrate, evaluate, run a YAML recipe, or the offline demo.

    hf-featcal merge     --base B --expert TASK=SRC ... --method task_arithmetic --output-dir DIR
    hf-featcal calibrate --model MERGED --base B --expert TASK=SRC ... --data TASK=DATASET ... --output-dir DIR
    hf-featcal evaluate  --model DIR --task TASK ... [--data TASK=DATASET ...]
    hf-featcal run       RECIPE.yaml
    hf-featcal demo      (offline, < 3 minutes on 2 CPU cores)
    hf-featcal compare   --demo | RECIPE.yaml   (merges × post-merging steps, one table)

Run ``hf-featcal <command> --help`` for every option; every command takes ``--device``, ``--quiet`` and
``--debug`` with the same defaults. Errors print one line: exit status 2 for a usage error (a bad option,
recipe key or path), 1 for a run that failed (a model that does not fit, an unreadable file); ``--debug``
shows the traceback instead. Commands without ``--output-dir`` (demo, compare --demo) write into a new
folder ``./outputs/<command>-<date>-<time>`` and print it.

One module per command (`merge`, `calibrate`, `evaluate`, `run`, `demo`, `compare`), each with
``register(commands)`` (its subparser) and ``run(args)``; `app` holds the parser and the entry point `main`,
`_common` what the commands share. A new command is a new module and one line in `app.COMMANDS`.
"""

from __future__ import annotations

from .app import build_parser, main

__all__ = ["build_parser", "main"]
