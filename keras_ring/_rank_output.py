"""Starts one rank of a one-host job with its output on `keras-ring-run`'s own pipes.

MPICH's forker (`mpiexec.gforker`) copies each rank's stdout and stderr one
`char` at a time and takes `fputc()`'s return value, the byte as unsigned, for
a write error whenever the byte is 0x80 or more: the first non-ASCII byte
(Keras's progress bar, any UTF-8 text) makes it close that rank's pipe, and
the rank's next write fails with `BrokenPipeError`. So `keras-ring-run` starts
each rank through this script, which puts the file descriptors that the
launcher handed down (through the forker, which passes them on) in place of
the forker's pipes and then becomes the rank's command (`exec`): the rank
writes to the launcher's stdout and stderr directly, or to pipes of its own
that the launcher copies line by line: both with `--prefix-output`, which
prefixes each line, and otherwise the stderr of ranks other than 0, from which
TensorFlow's start-up lines are left out.

`python -I -S _rank_output.py COMMAND...`, run by path so that nothing else is
imported. `KERAS_RING_RANK_OUTPUT_FDS` holds `OUT,ERR` (one pair for every
rank) or one pair per rank, separated by spaces, indexed by `PMI_RANK`.
"""

import os
import sys

VARIABLE = "KERAS_RING_RANK_OUTPUT_FDS"


def main(command):
    pairs = [tuple(int(fd) for fd in pair.split(",")) for pair in os.environ.pop(VARIABLE).split()]
    out, err = pairs[int(os.environ.get("PMI_RANK", "0"))] if len(pairs) > 1 else pairs[0]
    os.dup2(out, 1)
    os.dup2(err, 2)
    # Other ranks' pipes stay with their ranks, so that each pipe ends when its rank does.
    for fd in {fd for pair in pairs for fd in pair}:
        os.close(fd)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"keras-ring-run: cannot run {command[0]!r}: {e.strerror}\n")
        sys.stderr.flush()
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
