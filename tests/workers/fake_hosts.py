"""Runs a worker as if its ranks were spread over several hosts.

    keras-ring-run -np 4 python fake_hosts.py 2,2 worker.py [args...]

puts ranks 0-1 on "host0" and ranks 2-3 on "host1" by setting
KERAS_RING_HOSTNAME, which the engine uses instead of the host's own name to
group ranks by host. The ranks still share this machine, so the
shared-memory paths work within each pretended host.
"""

import os
import runpy
import sys

rank = int(os.environ.get("PMI_RANK") or os.environ.get("KERAS_RING_RANK")
           or os.environ["OMPI_COMM_WORLD_RANK"])
host_sizes = [int(n) for n in sys.argv[1].split(",")]
first = 0
for host, n in enumerate(host_sizes):
    if rank < first + n:
        os.environ["KERAS_RING_HOSTNAME"] = f"host{host}"
        os.environ["KR_TEST_LOCAL_SIZE"] = str(n)
        break
    first += n
else:
    raise SystemExit(f"rank {rank} is beyond the hosts {host_sizes}")
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
