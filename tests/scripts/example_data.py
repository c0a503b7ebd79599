"""Writes an example's dataset once, before its ranks start (run on one rank by the rank server).

    python tests/scripts/example_data.py examples/lightning_train.py FOLDER RECORDS

Under Lightning's own launcher rank 0 writes the data before it starts rank 1;
ranks started together (torchrun, the rank server) would both find no data and
write it at once, so the tests write it first with the example's own
``write_dataset`` and pass ``--data FOLDER``.
"""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    example, folder, records = sys.argv[1:]
    write_dataset = runpy.run_path(example, run_name="example")["write_dataset"]  # defines; does not train
    write_dataset(folder, int(records))
