"""`python -m localllm.cli ...`: how the client and the systemd unit start the daemon."""

import sys

from .main import main

sys.exit(main())
