"""``python -m hora doctor``: the ``hora`` command without the script on the PATH."""

import sys

from hora.cli import main

sys.exit(main())
