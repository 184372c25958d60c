"""``python -m kvpush.services.cli``: the same command as ``kvpush``."""

import sys

from kvpush.services.cli.main import main

sys.exit(main())
