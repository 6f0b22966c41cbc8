"""``python -m torch_distribute.launch --nproc N script.py args...``: the local launcher.

The same as ``torch-distribute launch``; see :mod:`torch_distribute.cluster.launcher`.
"""

from __future__ import annotations

import sys

from torch_distribute.cluster.launcher import main

if __name__ == "__main__":
    sys.exit(main())
