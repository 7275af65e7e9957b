"""The `KERAS_RING_*` environment variables keras-ring reads, to name a misspelled one.

A variable keras-ring does not read is ignored, so `KERAS_RING_FUSION_TRESHOLD`
would leave the setting at its default without a word; `init()` warns of it
instead, naming the closest variable keras-ring does read.
"""

import difflib

PREFIX = "KERAS_RING_"
# What users set: the settings of docs/settings.md, launching.md and elastic.md.
USER_SETTINGS = frozenset([
    "KERAS_RING_AUTOTUNE", "KERAS_RING_AUTOTUNE_LOG", "KERAS_RING_AUTOTUNE_STEPS_PER_SAMPLE",
    "KERAS_RING_AUTOTUNE_WARMUP_SAMPLES", "KERAS_RING_BUCKET_BYTES", "KERAS_RING_CACHE_CAPACITY",
    "KERAS_RING_CACHE_DIR", "KERAS_RING_CPU_KERNELS", "KERAS_RING_CYCLE_TIME",
    "KERAS_RING_DIVERGENCE", "KERAS_RING_ELASTIC_TIMEOUT", "KERAS_RING_FUSION_THRESHOLD",
    "KERAS_RING_HIERARCHICAL_ALLREDUCE", "KERAS_RING_HOSTNAME", "KERAS_RING_LOG_HIDE_TIME",
    "KERAS_RING_LOG_LEVEL", "KERAS_RING_MPICXX", "KERAS_RING_REMOTE_SHELL",
    "KERAS_RING_SEGMENT_BYTES", "KERAS_RING_SHM", "KERAS_RING_SHM_SLOT_BYTES",
    "KERAS_RING_SMALL_ALLREDUCE_BYTES", "KERAS_RING_STALL_CHECK_TIME",
    "KERAS_RING_STALL_SHUTDOWN_TIME", "KERAS_RING_TIMELINE", "KERAS_RING_TIMELINE_MARK_CYCLES",
    "KERAS_RING_TIMEOUT", "KERAS_RING_TRANSPORT",
])
# What keras-ring-run sets for the processes it starts.
LAUNCHER_SETTINGS = frozenset([
    "KERAS_RING_ELASTIC", "KERAS_RING_END_REPORT", "KERAS_RING_RANK", "KERAS_RING_RANK_END_FD",
    "KERAS_RING_RANK_OUTPUT_FDS", "KERAS_RING_RANK_STOP_FD", "KERAS_RING_RENDEZVOUS",
    "KERAS_RING_SECRET", "KERAS_RING_SIZE", "KERAS_RING_WORKER",
])
KNOWN = USER_SETTINGS | LAUNCHER_SETTINGS


def unknown_variables_message(environ):
    """A warning naming each `KERAS_RING_*` variable of `environ` that keras-ring does not read.

    Returns:
        The message, with the closest known name of each where one is close; or None.
    """
    unknown = sorted(name for name in environ if name.startswith(PREFIX) and name not in KNOWN)
    if not unknown:
        return None
    described = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(USER_SETTINGS), n=1, cutoff=0.8)
        described.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return (f"keras-ring does not read {', '.join(described)}: "
            f"{'it has' if len(unknown) == 1 else 'they have'} no effect. The settings are "
            "listed in docs/settings.md.")
