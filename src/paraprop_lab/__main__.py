"""``python -m paraprop_lab``: the ``paraprop`` command."""

import sys

from paraprop_lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
