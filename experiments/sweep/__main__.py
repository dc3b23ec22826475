import sys

from experiments.sweep.cli import main

sys.exit(main())
