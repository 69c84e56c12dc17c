"""`python -m qspec.bench merge|sweep ...` (the same as `qspec bench ...`)."""

import sys

from qspec.bench.cli import main

sys.exit(main())
