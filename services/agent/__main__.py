"""``python -m services.agent``: the same as ``vmfence agent``."""

from __future__ import annotations

import sys

from services.agent.service import main

if __name__ == "__main__":
    sys.exit(main())
