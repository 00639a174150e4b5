"""``mpirun -n 1 python tests/helpers/host_counts_worker.py MODEL CONFIG.json``: one real NumPy
run of three optimizer steps; during the last, zerosim's own Python calls counted by the dry
run's profile hook and the minor page faults the kernel counted (``dryrun.host.real_step_counts``).
Prints ``COUNTS <calls> <minor faults>``."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zerosim.dryrun.host import real_step_counts  # noqa: E402

if __name__ == "__main__":
    calls, faults = real_step_counts(sys.argv[1], json.loads(Path(sys.argv[2]).read_text()))
    print(f"COUNTS {calls} {faults}", flush=True)
