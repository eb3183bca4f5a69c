"""argparse building blocks shared by every sub-command: flags generated from config dataclasses, tier flags, checks."""
