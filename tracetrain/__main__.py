"""`python -m tracetrain <command>`: see tracetrain/cli.py."""

import sys

from tracetrain.cli import main

sys.exit(main())
