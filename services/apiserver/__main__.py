"""``python -m services.apiserver``: run the development API server."""

import sys

from .server import main

sys.exit(main())
