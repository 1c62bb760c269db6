"""``python -m tools.simulator ...``: the simulator's command line (tools/simulator/cli.py)."""
import sys

from tools.simulator.cli import main

sys.exit(main())
