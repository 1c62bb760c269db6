"""``python -m workers.preflight <standalone|job|node|bench>``: see workers/preflight/cli.py."""
from workers.preflight.cli import console_main

if __name__ == "__main__":
    console_main()
