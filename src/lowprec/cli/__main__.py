"""``python -m lowprec.cli``: the ``lowprec`` command."""

import sys

from . import main

sys.exit(main())
