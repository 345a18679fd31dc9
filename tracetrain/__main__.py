"""`python -m tracetrain <command>`: see tracetrain/cli.py."""

import os
import signal
import sys

if sys.argv[1:2] == ["train"]:  # a SIGTERM while the modules load: nothing of the run exists yet
    # (os._exit, not sys.exit: raised inside an import's weakref callback, SystemExit is dropped)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

from tracetrain.cli import main  # noqa: E402

sys.exit(main())
