"""`python -m tracetrain <command>`: see tracetrain/cli.py."""

import signal
import sys

if sys.argv[1:2] == ["train"]:  # a SIGTERM while the modules load: nothing of the run exists yet
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

from tracetrain.cli import main  # noqa: E402

sys.exit(main())
