"""``python -m hf_featcal``: the ``hf-featcal`` command (see `hf_featcal.cli`)."""

import sys

from .cli import main

sys.exit(main())
