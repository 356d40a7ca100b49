import sys

from .semantic import main

sys.exit(main())
