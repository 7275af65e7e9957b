"""One rank of a `kr.run` job: `python -m keras_ring.launcher._run_worker DIRECTORY`.

Reads the pickled function and arguments from DIRECTORY/payload.pkl, calls
the function, and writes ("ok", result) or ("error", exception, text,
traceback) to DIRECTORY/result.<rank>.pkl. Everything the process writes to
stdout and stderr, C libraries included, is prefixed with "[rank] ".
"""

import os
import pickle
import sys
import threading
import traceback

import cloudpickle


def _launcher_rank():
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "KERAS_RING_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


class _PrefixedOutput:
    """Routes file descriptors 1 and 2 through a pipe that prefixes every line."""

    def __init__(self, prefix):
        self._prefix = prefix.encode()
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        self._pumps = []
        for fd in (1, 2):
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            pump = threading.Thread(target=self._pump, args=(read_end, os.dup(self._saved[fd])),
                                    daemon=True)
            pump.start()
            self._pumps.append(pump)

    def _pump(self, source, target):
        with os.fdopen(source, "rb") as lines, os.fdopen(target, "wb", buffering=0) as out:
            for line in lines:
                out.write(self._prefix + line)

    def close(self):
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # closes the pipe's last write end: the pump drains and ends
            os.close(saved)
        for pump in self._pumps:
            pump.join(timeout=5)


def _outcome(fn, args, kwargs):
    """("ok", result) or ("error", exception or None, text, traceback) of `fn(*args, **kwargs)`."""
    try:
        return ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 -- every failure goes back to the caller
        text = f"{type(e).__name__}: {e}"
        try:
            exception = pickle.loads(cloudpickle.dumps(e))
        except Exception:  # noqa: BLE001 -- unpicklable: the text stands in
            exception = None
        return ("error", exception, text, traceback.format_exc())


def main(directory):
    rank = _launcher_rank()
    output = _PrefixedOutput(f"[{rank}] ")
    try:
        with open(os.path.join(directory, "payload.pkl"), "rb") as f:
            fn, args, kwargs = pickle.load(f)
        result = _outcome(fn, args, kwargs)
        try:
            data = cloudpickle.dumps(result)
        except Exception as e:  # noqa: BLE001 -- the result cannot travel back
            data = cloudpickle.dumps(("error", None, f"the result of rank {rank} cannot be "
                                      f"pickled: {type(e).__name__}: {e}", ""))
        path = os.path.join(directory, f"result.{rank}.pkl")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    finally:
        output.close()
    return 0 if result[0] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
