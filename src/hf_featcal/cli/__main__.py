"""``python -m hf_featcal.cli``: the ``hf-featcal`` command."""

import sys

from .app import main

sys.exit(main())
