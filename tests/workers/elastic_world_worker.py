"""A worker of an elastic job whose driver is the test (no Keras, no kr.elastic).

It joins the world the driver gives, allreduces its rank (through the NumPy
binding, or TensorFlow's op with `KR_TEST_TF=1`), and exits when told
`KR_TEST_KILL_SELF` names its first rank (SIGKILL, no exit code runs). A
survivor's collective then fails with `WorkerLostError`; it shuts its engine
down, asks for a new world and allreduces again there, in the same process.
"""

import os
import signal
import sys

import numpy as np

import keras_ring as kr
from keras_ring.core import _elastic_world, _engine
from keras_ring.core._errors import WorkerLostError

if os.environ.get("KR_TEST_TF") == "1":
    import tensorflow as tf

    from keras_ring.core._errors import worker_lost

    def total_of_ranks(step):
        # A TF op reports the loss as tf.errors.UnavailableError: worker_lost() knows it.
        try:
            return int(kr.allreduce(tf.constant([kr.rank()], tf.int64), op=kr.Sum,
                                    name=f"ranks.{step}").numpy()[0])
        except tf.errors.OpError as e:
            raise (worker_lost(e) or e) from e
else:
    def total_of_ranks(step):
        out = _engine.submit(_engine.ALLREDUCE, np.array([kr.rank()], np.int64),
                             f"ranks.{step}")
        return int(out.wait()[0])


kr.init()
first_rank = kr.rank()
print(f"worker {os.environ['KERAS_RING_WORKER']} pid {os.getpid()}: rank {kr.rank()} of "
      f"{kr.size()}", flush=True)
assert total_of_ranks(0) == sum(range(kr.size()))
if os.environ.get("KR_TEST_KILL_SELF") == str(first_rank):
    os.kill(os.getpid(), signal.SIGKILL)
try:
    for step in range(1, 1000):
        total_of_ranks(step)
    sys.exit("the job went on without noticing the lost worker")
except WorkerLostError as e:
    print(f"first rank {first_rank} lost a worker: {e}", flush=True)
    _elastic_world.set_reason(e)
kr.shutdown()
kr.init()
total = total_of_ranks("new")
print(f"first rank {first_rank}: now rank {kr.rank()} of {kr.size()}, total {total}", flush=True)
assert total == sum(range(kr.size()))
kr.shutdown()
