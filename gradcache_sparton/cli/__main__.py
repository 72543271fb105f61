"""``python -m gradcache_sparton.cli``: the console entry point (also for ``accelerate launch --module``)."""

import sys

from gradcache_sparton.cli.app import main

sys.exit(main())
