"""What every kind of job shares: the error the launcher explains, and a rank's output, copied.

MPI jobs under the forker (`_main`), TCP jobs (`_tcp_jobs`) and elastic jobs
(`_elastic_driver`) all copy a rank's pipe to the launcher's own output with
a `RankStream`.
"""

import re

# A rank's pipe (--prefix-output, or stderr quieted): an unfinished line is
# written after this much quiet, or once it is this long; pipes a rank's child keeps open are
# read this long after the job.
PARTIAL_LINE_SECONDS = 0.1
MAX_PARTIAL_LINE = 65536
DRAIN_SECONDS = 5
# TensorFlow's start-up lines that say the same on every rank of a host (about its build, the
# CPU, the CUDA libraries), most written before absl's logging is set up, where
# TF_CPP_MIN_LOG_LEVEL does not reach. Under the forker ranks other than 0 leave them out of their
# stderr (docs/decisions/0001-quiet-ranks.md): only a whole line that is one of these, possibly
# after the `[rank] ` that kr.run's workers add.
_TF_LOG_HEADER = (
    # absl's, whose seconds count from 1970 before it is set up: I0000 00:00:1796176450.224363 5878
    rb"(?:[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ "
    rb"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] )"  # TF's own: 2025-02-09 09:37:32.334667: E
    rb"[\w./-]+:\d+\] "
)
_TF_START_UP_MESSAGES = (
    "oneDNN custom operations are on. You may see slightly different numerical results due to "
    "floating-point round-off errors from different computation orders. To turn them off, set "
    "the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "This TensorFlow binary is optimized to use available CPU instructions in "
    "performance-critical operations.",
    "Could not find cuda drivers on your machine, GPU will not be used.",
    *(f"Unable to register {plugin} factory: Attempting to register factory for plugin {plugin} "
      "when one has already been registered" for plugin in ("cuDNN", "cuFFT", "cuBLAS")),
    "computation placer already registered. Please check linkage and avoid linking the same "
    "target more than once.",
    "TF-TRT Warning: Could not find TensorRT",
)
_TF_START_UP_LINE = re.compile(
    rb"(?:\[\d+\] )?(?:"
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|To enable the following instructions: [\w ]+, in other operations, rebuild TensorFlow "
    rb"with the appropriate compiler flags\."
    rb"|" + _TF_LOG_HEADER + rb"(?:"
    + b"|".join(re.escape(m.encode()) for m in _TF_START_UP_MESSAGES) + rb"))\r?\n"
)



class LaunchError(Exception):
    """A problem `keras-ring-run` explains in one paragraph before exiting with 2."""


class RankStream:
    """One rank's stdout or stderr pipe, copied to ours line by line.

    With a prefix, `prefix` goes before each line; a carriage return starts a
    line too, so that a progress bar redrawn in place (Keras's) keeps it.
    Quiet, the lines `_TF_START_UP_LINE` matches are left out. Whole lines are
    written as they come, one write each, so that ranks' lines do not mix; the
    unfinished end of a line waits until more comes, the pipe is quiet
    (`flush`), or it grows past `MAX_PARTIAL_LINE`.

    Args:
        fd: The pipe's read end.
        dest: `sys.stdout` or `sys.stderr`.
        prefix: What goes before each line, e.g. `"[1] "`, or `""`.
        quiet: Whether TensorFlow's start-up lines are left out.
    """

    _LINE_ENDS = re.compile(rb"(?<=\n)|(?<=\r)(?!\n)")

    def __init__(self, fd, dest, prefix, quiet):
        self.fd = fd
        self.dest = dest.buffer
        self.prefix = prefix.encode()
        self.quiet = quiet
        self.partial = b""  # read but not yet written
        self.line_start = True  # whether the next byte written starts a line

    def feed(self, chunk):
        """Writes the whole lines of what was read; returns False if our reader has gone."""
        data = self.partial + chunk
        end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        if len(data) - end > MAX_PARTIAL_LINE:
            end = len(data)
        self.partial = data[end:]
        return self._write(data[:end])

    def flush(self):
        """Writes what is left of an unfinished line; returns False if our reader has gone."""
        data, self.partial = self.partial, b""
        return self._write(data)

    def _write(self, data):
        try:
            for piece in self._LINE_ENDS.split(data):
                # A line cut by `flush` or `MAX_PARTIAL_LINE` is shown: its halves match nothing.
                if not piece or (self.quiet and self.line_start
                                 and _TF_START_UP_LINE.fullmatch(piece)):
                    continue
                # One write per line, as a rank writes its own: where other ranks write to the
                # same pipe directly, their lines and ours (up to 4 KiB) do not cut into each other.
                self.dest.write(self.prefix + piece if self.line_start else piece)
                self.dest.flush()
                self.line_start = piece.endswith((b"\n", b"\r"))
        except BrokenPipeError:
            return False
        return True
