import sys

from kimik3.cli import console

sys.exit(console())
