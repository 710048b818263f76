"""Multi-process tests under torchrun: ``torchrun --standalone --nproc-per-node 2
tests/distributed/run.py [scenario ...]``.

NCCL on the GPUs (one per rank, ``LOCAL_RANK``), gloo where there is no CUDA. Rank 0 prints one
line per scenario (``dist_scenarios.SCENARIOS``: DDP, FSDP2 and a 1F1B pipeline, each with
TransformerEngine's call shape and with ``OffloadActivations``) and the problems found; the exit
status is 1 if any. ``pytest -m distributed`` runs this on a machine with two GPUs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_scenarios import torchrun_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(torchrun_main())
