"""Runs engine_worker.py's checks, then says where this rank ran and what its engine counted.

    keras-ring-run -np 4 -H host0:2,host1:2 python netns_worker.py

prints, after engine_worker.py's lines, one line per rank:

    rank R: where {"netns": ..., "hostname": ..., "local_size": ..., ..., "stats": {...}}

with the inode of the rank's network namespace, its host name, KR_TEST_CANARY
(a value of the launching shell's environment), its place in the
job (local and cross rank and size) and the engine's stats as test_transport
(which checks the path against KR_TEST_PATH) saw them, before test_restart
starts the engine again.
"""

import importlib.util
import json
import os
import socket
from pathlib import Path

import keras_ring as kr
from keras_ring.core import _engine

spec = importlib.util.spec_from_file_location(
    "engine_worker", Path(__file__).with_name("engine_worker.py"))
engine_worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine_worker)
seen = {}
check_transport = engine_worker.test_transport


def test_transport(rank, size):
    check_transport(rank, size)
    seen.update(_engine.stats())


engine_worker.test_transport = test_transport  # main() looks it up when it runs
engine_worker.main()
where = {
    "netns": os.stat("/proc/self/ns/net").st_ino,
    "hostname": socket.gethostname(),
    "KERAS_RING_HOSTNAME": os.environ.get("KERAS_RING_HOSTNAME"),
    "canary": os.environ.get("KR_TEST_CANARY"),
    "local_rank": kr.local_rank(),
    "local_size": kr.local_size(),
    "cross_rank": kr.cross_rank(),
    "cross_size": kr.cross_size(),
    "stats": seen,
}
print(f"rank {kr.rank()}: where {json.dumps(where)}", flush=True)
