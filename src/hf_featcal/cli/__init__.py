"""The ``hf-featcal`` command line: merge, calibrate, evaluate, run a YAML recipe, or the offline demo.

    hf-featcal merge     --base B --expert TASK=SRC ... --method task_arithmetic --output-dir DIR
    hf-featcal calibrate --model MERGED --base B --expert TASK=SRC ... --data TASK=DATASET ... --output-dir DIR
    hf-featcal evaluate  --model DIR --task TASK ... [--data TASK=DATASET ...]
    hf-featcal run       RECIPE.yaml
    hf-featcal demo      (offline, < 3 minutes on 2 CPU cores)
    hf-featcal compare   --demo | RECIPE.yaml   (merges × post-merging steps, one table)

Run ``hf-featcal <command> --help`` for every option. Errors in what was given (a bad recipe key, a
missing path, a model that does not fit) print one line and exit with status 2; ``--debug``
shows the traceback instead.

One module per command (`merge`, `calibrate`, `evaluate`, `run`, `demo`, `compare`), each with
``register(commands)`` (its subparser) and ``run(args)``; `app` holds the parser and the entry point `main`,
`_common` what the commands share. A new command is a new module and one line in `app.COMMANDS`.
"""

from __future__ import annotations

from .app import build_parser, main

__all__ = ["build_parser", "main"]
