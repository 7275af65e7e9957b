"""Process sets: subsets of the job's ranks that run collectives among themselves.

As in Horovod, a `ProcessSet` names its members by world rank; once added
(`add_process_set`, or `init(process_sets=[...])`) it has an id, and every
collective takes `process_set=` to run among its members only, with ranks
and sizes counted within the set; `root_rank` and the rank `join` returns are
world ranks, as in Horovod. Adding and removing are
collective over the whole job: every rank calls them, in the same order, with
the same ranks, members or not.
"""

import numbers
import weakref

from keras_ring.core import _basics

_added = weakref.WeakSet()


class ProcessSet:
    """A set of world ranks that run collectives among themselves.

    Args:
        ranks: The members' world ranks (any order; each once).

    Example:

    ```python
    # Every rank adds the set; only its members run its collectives.
    evens = kr.add_process_set(kr.ProcessSet(range(0, kr.size(), 2)))
    if evens.included():
        total = kr.allreduce(x, op=kr.Sum, process_set=evens)
    ```
    """

    def __init__(self, ranks):
        try:
            ranks = sorted(int(r) for r in ranks)
        except (TypeError, ValueError):
            raise TypeError(
                f"ProcessSet takes a sequence of integer ranks. Received: {ranks!r}"
            ) from None
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must not repeat. Received: {ranks}")
        self.ranks = ranks
        self.process_set_id = None

    def _registered(self, what):
        if self.process_set_id is None:
            raise ValueError(
                f"keras-ring: {what} needs a process set added with add_process_set() "
                f"(or init(process_sets=...)). Received: {self}"
            )
        if self is not global_process_set and not any(s is self for s in _added):
            raise ValueError(
                f"keras-ring: {what} got a process set with id {self.process_set_id} that "
                "add_process_set() did not return (removed, or its id set by hand). "
                f"Received: {self}"
            )
        _basics._require_initialized(what)

    def size(self):
        """Returns the number of ranks in the set."""
        self._registered("ProcessSet.size()")
        return len(self.ranks)

    def rank(self):
        """Returns this process's rank within the set, or -1 if it is not a member."""
        self._registered("ProcessSet.rank()")
        me = _basics.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self):
        """Returns True if this process is a member of the set."""
        return self.rank() >= 0

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job; its ranks are known once keras-ring is initialised.

    The default `process_set=` of the collectives.

    Example:

    ```python
    kr.init()
    assert kr.global_process_set.size() == kr.size()
    ```
    """

    def __init__(self):
        self.process_set_id = 0

    @property
    def ranks(self):
        return list(range(_basics.size())) if _basics.is_initialized() else []


global_process_set = _GlobalProcessSet()


def process_set_id(process_set):
    """The engine's id for a `process_set=` argument (None means the whole job)."""
    if process_set is None:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            "`process_set` must be a keras_ring.ProcessSet (see add_process_set). "
            f"Received: process_set={process_set!r}"
        )
    process_set._registered("a collective with process_set=")
    return process_set.process_set_id


def describe(process_set):
    """The engine's id of a `process_set=` argument, the set's size and this rank in it."""
    set_id = process_set_id(process_set)
    if set_id == 0:
        return 0, _basics.size(), _basics.rank()
    return set_id, process_set.size(), process_set.rank()


def root_index(process_set, root_rank):
    """The index within `process_set` of `root_rank`, a world rank (Horovod's convention).

    Raises:
        ValueError: If `root_rank` is not an integer rank of the set.
    """
    set_id, size, _ = describe(process_set)
    members = list(range(size)) if set_id == 0 else process_set.ranks
    if (
        isinstance(root_rank, bool)
        or not isinstance(root_rank, numbers.Integral)
        or root_rank not in members
    ):
        which = f"an integer in [0, {size})" if set_id == 0 else f"one of the set's {members}"
        raise ValueError(
            f"`root_rank` must be a rank, {which}. Received: root_rank={root_rank!r}"
        )
    return members.index(root_rank)


def world_rank(process_set, index):
    """The world rank of the member at `index` of `process_set`."""
    return index if process_set_id(process_set) == 0 else process_set.ranks[index]


def by_id(set_id):
    """The registered `ProcessSet` with this id (0: the global one)."""
    if set_id == 0:
        return global_process_set
    for process_set in list(_added):
        if process_set.process_set_id == set_id:
            return process_set
    raise ValueError(f"keras-ring: there is no process set with id {set_id} (removed?)")


def add_process_set(process_set):
    """Adds a process set to the running job. Collective over every rank.

    Args:
        process_set: A `ProcessSet`, or a sequence of world ranks.

    Returns:
        The `ProcessSet`, now with its `process_set_id`.

    Raises:
        ValueError: If the set was added already, a rank is out of range, or
            the ranks disagree on the members (the error names each rank's list).

    Example:

    ```python
    kr.init()
    first_two = kr.add_process_set([0, 1])  # called on every rank, members or not
    ```
    """
    _basics._require_initialized("add_process_set()")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"keras-ring: add_process_set: {process_set} has been added already")
    process_set.process_set_id = _basics._engine().add_process_set(process_set.ranks)
    _added.add(process_set)
    return process_set


def remove_process_set(process_set):
    """Removes a process set added before. Collective over every rank.

    Its pending collectives fail with an error; its id is never reused.

    Args:
        process_set: The `ProcessSet` to remove.

    Returns:
        True if it was removed, False if it was not registered.

    Example:

    ```python
    kr.remove_process_set(first_two)  # called on every rank
    ```
    """
    if isinstance(process_set, _GlobalProcessSet):
        raise ValueError("keras-ring: the global process set cannot be removed")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes a ProcessSet. Received: {process_set!r}")
    if process_set.process_set_id is None:
        return False
    _basics._require_initialized("remove_process_set()")
    _basics._engine().remove_process_set(process_set.process_set_id)
    process_set.process_set_id = None
    _added.discard(process_set)
    return True


def _forget_all():
    # shutdown() ends every set; a later init() starts with the global one only.
    for process_set in list(_added):
        process_set.process_set_id = None
    _added.clear()
