"""`python -m hicache_fsm` runs the command line, like the `hicache-fsm` script."""
import sys

from hicache_fsm.cli import main

sys.exit(main())
