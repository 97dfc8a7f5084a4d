import sys

from bigtrain.entry_point import main

sys.exit(main())
