"""``python -m shardkit``: the ``shardkit`` command line (:func:`shardkit.cli.main`), for when the console
script is not on ``PATH`` (a venv not activated, ``pip install --user``)."""

import sys

from shardkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
