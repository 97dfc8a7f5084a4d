import sys

from bigtrain.cli import main

sys.exit(main())
