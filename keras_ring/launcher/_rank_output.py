"""Starts one rank of a one-host job: its output on `keras-ring-run`'s own pipes, its end reported.

MPICH's forker (`mpiexec.gforker`) copies each rank's stdout and stderr one
`char` at a time and takes `fputc()`'s return value, the byte as unsigned, for
a write error whenever the byte is 0x80 or more: the first non-ASCII byte
(Keras's progress bar, any UTF-8 text) makes it close that rank's pipe, and
the rank's next write fails with `BrokenPipeError`. So `keras-ring-run` starts
each rank through this script, which puts the file descriptors that the
launcher handed down (through the forker, which passes them on) in place of
the forker's pipes before it starts the rank's command: the rank writes to the
launcher's stdout and stderr directly, or to pipes of its own that the
launcher copies line by line: both with `--prefix-output`, which prefixes each
line, and otherwise the stderr of ranks other than 0, from which TensorFlow's
start-up lines are left out.

The forker reports only the ranks that ended with a non-zero status, after the
job, and stops the others once one rank ends without MPI_Finalize; it cannot
say which rank started the job's end. So this script stays the command's
parent: once the command has ended it writes one line to `keras-ring-run`
(`RANK STATUS ENDED STOPPED`: the wait status, the `time.monotonic()` of the
end, and that of the first signal the forker sent, or `-`) and ends the same
way the command did. It passes on the signals processes send it (those of the
terminal reach the command themselves), but holds those of the forker's own
stop (SIGINT, then SIGQUIT a second later) for `_STOP_GRACE_SECONDS`: the
rank's engine sees its peer's death by then and the rank ends with its own
error, which a KeyboardInterrupt in the middle would garble and SIGQUIT cut
off. A signal the user sent `keras-ring-run` is passed on at once:
`keras-ring-run` then closes the pipe whose read end this script holds.

`python -I -S _rank_output.py COMMAND...`, run by path so that nothing else is
imported. `KERAS_RING_RANK_OUTPUT_FDS` holds `OUT,ERR` (one pair for every
rank) or one pair per rank, separated by spaces, indexed by `PMI_RANK`;
`KERAS_RING_RANK_END_FD` the pipe the end is reported on, `KERAS_RING_RANK_STOP_FD` the
pipe that ends when the user has asked the job to stop. The command gets the
first pipe as `KERAS_RING_END_REPORT=fd:N`, to report its own end on
(`keras_ring/core/_end_report.py`).
"""

import os
import resource
import select
import signal
import sys
import time

VARIABLE = "KERAS_RING_RANK_OUTPUT_FDS"
END_VARIABLE = "KERAS_RING_RANK_END_FD"
STOP_VARIABLE = "KERAS_RING_RANK_STOP_FD"
END_REPORT_VARIABLE = "KERAS_RING_END_REPORT"  # keras_ring.core._end_report.VARIABLE, not imported
# How long the forker's own stop is held back; engines see a dead peer within a second.
_STOP_GRACE_SECONDS = 3
# What is passed on to the command: the signals that ask a process to end, or that it may use.
_PASSED_ON = frozenset([
    signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1,
    signal.SIGUSR2, signal.SIGALRM, signal.SIGWINCH,
])
# siginfo's si_code of a signal the kernel raised itself (the terminal's Ctrl-C); a process's
# kill() has 0 (SI_USER) or below.
_SI_KERNEL = 0x80


def main(command):
    pairs = [tuple(int(fd) for fd in pair.split(",")) for pair in os.environ.pop(VARIABLE).split()]
    end_fd = int(os.environ.pop(END_VARIABLE))
    stop_fd = int(os.environ.pop(STOP_VARIABLE))
    rank = int(os.environ.get("PMI_RANK", "0"))
    out, err = pairs[rank] if len(pairs) > 1 else pairs[0]
    os.dup2(out, 1)
    os.dup2(err, 2)
    # Other ranks' pipes stay with their ranks, so that each pipe ends when its rank does.
    for fd in {fd for pair in pairs for fd in pair}:
        os.close(fd)
    waited = _PASSED_ON | {signal.SIGCHLD}
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    pid = os.fork()
    if pid == 0:
        # The rank reports its own end on the same pipe (keras_ring/core/_end_report.py).
        os.environ[END_REPORT_VARIABLE] = f"fd:{end_fd}"
        os.close(stop_fd)
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        try:
            os.execvp(command[0], command)
        except OSError as e:
            sys.stderr.write(f"keras-ring-run: cannot run {command[0]!r}: {e.strerror}\n")
            sys.stderr.flush()
            os._exit(127)
    forker = os.getppid()
    stopped = "-"
    held = []  # the forker's signals, in order
    pass_on_at = None  # when they are passed on; after that, everything at once
    while True:
        if pass_on_at is None or not held:
            info = signal.sigwaitinfo(waited)
        else:
            info = signal.sigtimedwait(waited, max(0.0, pass_on_at - time.monotonic()))
        if info is None:  # the grace is over
            for signum in held:
                os.kill(pid, signum)
            held = []
        elif info.si_signo == signal.SIGCHLD:
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                break
        elif info.si_code != _SI_KERNEL:
            if info.si_pid == forker and stopped == "-":
                stopped = f"{time.monotonic():.6f}"
            asked = select.select([stop_fd], [], [], 0)[0]
            if info.si_pid == forker and not asked and (
                    pass_on_at is None or time.monotonic() < pass_on_at):
                pass_on_at = pass_on_at or time.monotonic() + _STOP_GRACE_SECONDS
                held.append(info.si_signo)
            else:
                os.kill(pid, info.si_signo)
    os.write(end_fd, f"{rank} {status} {time.monotonic():.6f} {stopped}\n".encode())
    if os.WIFSIGNALED(status):
        # Ended by the same signal, without a core file of this process.
        signum = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
