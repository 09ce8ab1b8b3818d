"""`python -m poot ...`: the poot command, straight from a git checkout."""
import sys

from .cli import main

sys.exit(main())
