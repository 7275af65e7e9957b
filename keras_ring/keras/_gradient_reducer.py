"""Gradient reduction across ranks, shared by DistributedOptimizer and DistributedGradientTape.

Gradients are reduced in groups, one grouped collective per group, in an
order that is the same on every rank. By default the groups are buckets of
about KERAS_RING_BUCKET_BYTES, filled from the last variable backwards, the
order in which backpropagation produces gradients: in a `tf.function` (as
in `model.fit`) a bucket's collective starts as soon as its gradients exist,
while the earlier layers' gradients are still being computed. Each group is
named after its key (a bucket or group number) under a prefix that the
Keras backend makes unique per use in a traced step (TF: a name scope inside
a `tf.function`; JAX: a count of reductions traced), so two optimizers or
tapes in one step never share a collective's name, and every rank that
traced the same step derives the same names. What differs per framework is
in `keras_ring.keras._backends`.
"""

import numbers
import os

import keras

from keras_ring.core._compression import Compression
from keras_ring.core._process_sets import ProcessSet, global_process_set
from keras_ring.core._reduce_ops import NAMES as _REDUCE_OP_NAMES
from keras_ring.core._reduce_ops import Average, Sum, refuse_adasum
from keras_ring.keras import _backends


def local_layer_list(local_layers):
    """Returns the `local_layers` argument of the `Partial*` APIs as a list of layers.

    Args:
        local_layers: `None`, a `keras.layers.Layer`, or a list of them.

    Returns:
        A list of layers, empty for `None`.

    Raises:
        ValueError: If `local_layers` holds anything but layers.
    """
    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else local_layers
    if not isinstance(layers, (list, tuple)) or not all(
        isinstance(layer, keras.layers.Layer) for layer in layers
    ):
        raise ValueError(
            "`local_layers` must be a keras.layers.Layer or a list of them. "
            f"Received: local_layers={local_layers!r}"
        )
    return list(layers)


DEFAULT_BUCKET_BYTES = 4 << 20


def bucket_bytes():
    """Returns KERAS_RING_BUCKET_BYTES (default 4 MiB; 0: one collective per dtype).

    Raises:
        ValueError: If the variable is not a non-negative integer.
    """
    text = os.environ.get("KERAS_RING_BUCKET_BYTES", "")
    if not text:
        return DEFAULT_BUCKET_BYTES
    if not text.isdigit():
        raise ValueError(
            f"KERAS_RING_BUCKET_BYTES must be a number of bytes (0: one collective per dtype). "
            f"Received: {text!r}"
        )
    return int(text)


def _is_count(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class GradientReducer:
    """Averages (or sums) gradients across ranks, with Horovod's options.

    Args:
        name: Name scope of the collectives; their names derive from it.
        api: The public name of the user of this reducer, for messages.
        device_dense: Device on which to reduce dense gradients.
        device_sparse: Device on which to gather `tf.IndexedSlices`.
        compression: A compressor from `keras_ring.Compression`; applied to
            dense gradients only.
        sparse_as_dense: If `True`, `tf.IndexedSlices` are converted to
            dense tensors and reduced; otherwise their rows are gathered.
        op: `keras_ring.Average` or `keras_ring.Sum`.
        gradient_predivide_factor: With `Average`, each rank multiplies its
            gradients by `1 / gradient_predivide_factor` before the sum and
            the sum is multiplied by `gradient_predivide_factor / size`.
        groups: `None` (buckets of about KERAS_RING_BUCKET_BYTES from the
            last gradient backwards, or one collective per dtype if that is
            0), a positive integer (that many collectives over consecutive
            gradients), or a list of lists of variables: the gradients of
            each list share a collective, and every other gradient has its
            own.
        num_groups: Same as an integer `groups`; 0 means unset.
        process_set: The `keras_ring.ProcessSet` whose ranks average the
            gradients (`None`: all ranks). Only its members may use the
            reducer; Average divides by the set's size.
        scale_local_gradients: Whether the gradients of local sources (see
            `register_local_source`) are divided by the size of the process
            set, as Horovod does.
        backend: The module of `keras_ring.keras._backends` to reduce with;
            by default, that of the Keras backend in use.

    Raises:
        ValueError: If an argument is invalid.
    """

    def __init__(
        self,
        name,
        api,
        device_dense="",
        device_sparse="",
        compression=Compression.none,
        sparse_as_dense=False,
        op=Average,
        gradient_predivide_factor=1.0,
        groups=None,
        num_groups=0,
        process_set=None,
        scale_local_gradients=True,
        backend=None,
    ):
        if not isinstance(name, str) or not name:
            raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
        for arg, device in (("device_dense", device_dense), ("device_sparse", device_sparse)):
            if not isinstance(device, str):
                raise ValueError(
                    f"`{arg}` must be a device string ('' for the default). "
                    f"Received: {arg}={device!r}"
                )
        if not (
            callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))
        ):
            raise ValueError(
                "`compression` must be keras_ring.Compression.none, .fp16 or .bf16 (or a "
                f"class with compress and decompress). Received: compression={compression!r}"
            )
        if not isinstance(sparse_as_dense, bool):
            raise ValueError(
                f"`sparse_as_dense` must be True or False. Received: "
                f"sparse_as_dense={sparse_as_dense!r}"
            )
        refuse_adasum(op)
        if not _is_count(op) or op not in (Average, Sum):
            shown = _REDUCE_OP_NAMES.get(op, repr(op)) if _is_count(op) else repr(op)
            raise ValueError(
                "`op` must be keras_ring.Average or keras_ring.Sum for gradients. "
                f"Received: op={shown}"
            )
        if (
            isinstance(gradient_predivide_factor, bool)
            or not isinstance(gradient_predivide_factor, numbers.Real)
            or not gradient_predivide_factor > 0
        ):
            raise ValueError(
                "`gradient_predivide_factor` must be a positive number. "
                f"Received: gradient_predivide_factor={gradient_predivide_factor!r}"
            )
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError(
                "`gradient_predivide_factor` applies to op=keras_ring.Average only. "
                f"Received: gradient_predivide_factor={gradient_predivide_factor!r}, "
                f"op={_REDUCE_OP_NAMES[op]}"
            )
        if process_set is not None and not isinstance(process_set, ProcessSet):
            raise ValueError(
                "`process_set` must be a keras_ring.ProcessSet (added with add_process_set or "
                f"init(process_sets=...)) or None for all ranks. Received: "
                f"process_set={process_set!r}"
            )
        if not isinstance(scale_local_gradients, bool):
            raise ValueError(
                "`scale_local_gradients` must be True or False. "
                f"Received: scale_local_gradients={scale_local_gradients!r}"
            )
        self.name = name
        self._api = api
        self._device_dense = device_dense
        self._device_sparse = device_sparse
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = int(op)
        # Horovod's split of the average around the sum, which keeps
        # float16 sums in range: the kernel divides by the size itself.
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = float(gradient_predivide_factor)
        self._num_groups, self._variable_groups = self._parse_groups(groups, num_groups)
        self._process_set = process_set or global_process_set
        self._scale_local = scale_local_gradients
        # Sources by id (Keras 3 variables are not hashable by value), kept
        # alive so that their ids are not reused; and layers, whose trainable
        # weights are read at each reduction, so that layers built later count.
        self._local_sources = {}
        self._local_layers = []
        self._backend = backend

    def register_local_source(self, source):
        """Makes the gradient of `source` local: never reduced, only scaled.

        Args:
            source: A variable (or tensor) whose gradient each rank keeps.
        """
        self._local_sources[id(source)] = source

    def register_local_layers(self, layers):
        """Makes the gradients of the trainable weights of `layers` local.

        Args:
            layers: A list of `keras.layers.Layer` (see `local_layer_list`).
        """
        self._local_layers.extend(layers)

    @property
    def process_set(self):
        """The `ProcessSet` whose ranks reduce the gradients."""
        return self._process_set

    def is_local(self, source):
        """Whether the gradient of `source` stays on its rank."""
        return id(source) in self.local_ids()

    def local_ids(self):
        """The ids of the variables whose gradients stay on their rank."""
        ids = set(self._local_sources)
        ids.update(id(v) for layer in self._local_layers for v in layer.trainable_weights)
        return ids

    @staticmethod
    def _parse_groups(groups, num_groups):
        if not _is_count(num_groups) or num_groups < 0:
            raise ValueError(
                "`num_groups` must be a non-negative integer (0: one collective per dtype). "
                f"Received: num_groups={num_groups!r}"
            )
        if groups is None:
            return int(num_groups), None
        if num_groups:
            raise ValueError(
                "Pass `groups` or `num_groups`, not both. "
                f"Received: groups={groups!r}, num_groups={num_groups!r}"
            )
        if _is_count(groups) and groups > 0:
            return int(groups), None
        if isinstance(groups, (list, tuple)) and all(
            isinstance(group, (list, tuple)) for group in groups
        ):
            return 0, [list(group) for group in groups]
        raise ValueError(
            "`groups` must be None, a positive integer, or a list of lists of variables. "
            f"Received: groups={groups!r}"
        )

    def reduce(self, grads, variables=None):
        """Reduces a list of gradients across ranks.

        Args:
            grads: A list of gradients (tensors, `tf.IndexedSlices` or
                `None`), in the same order on every rank.
            variables: The variables of `grads`, one for one; needed only
                when `groups` lists variables.

        Returns:
            A list of the reduced gradients, with `None` where `grads` had
            `None`. The gradients of local sources are not reduced: they are
            this rank's own, divided by the process set's size if
            `scale_local_gradients`. On a rank outside the process set,
            `grads` as they are (as in Horovod).

        Raises:
            ValueError: Under a `tf.distribute` strategy, inside an XLA
                compilation, or if `groups` lists variables or sources are
                registered as local, and `variables` is `None`.
        """
        backend = self._backend or _backends.current()
        backend.check_step(self._api)
        given = list(grads)
        if not self._process_set.included():
            return given
        local = self._local_positions(variables)
        # The gradients to reduce: None stands for local ones.
        grads = [None if i in local else g for i, g in enumerate(given)]
        if self._sparse_as_dense:
            grads = [None if g is None else backend.densify(g) for g in grads]
        results = [self._scaled_local(given[i], backend) if i in local else g
                   for i, g in enumerate(grads)]
        # Partitioned first: its checks apply with any number of ranks.
        partition = self._partition(grads, variables, backend)
        if self._is_identity():
            return results
        with backend.group_names(self.name) as name_of:
            for key, indices in partition:
                # Gathered rows (IndexedSlices) are not summed, so the
                # collective does not compress them (Horovod does not either).
                reduced = backend.grouped_allreduce(
                    [grads[i] for i in indices],
                    self._op,
                    self._compression,
                    self._prescale,
                    self._postscale,
                    name_of(key),
                    self._process_set,
                    self._device_dense,
                    self._device_sparse,
                )
                for i, r in zip(indices, reduced):
                    results[i] = r
        return results

    def _local_positions(self, variables):
        ids = self.local_ids()
        if not ids:
            return set()
        if variables is None:
            raise ValueError(
                f"keras_ring.{self._api} has local variables, so it needs the variables of the "
                "gradients: pass them (optimizer.apply(grads, trainable_variables) or "
                "tape.gradient(target, sources))."
            )
        return {i for i, v in enumerate(variables) if id(v) in ids}

    def _scaled_local(self, grad, backend):
        # Horovod divides local gradients by the size, so that an optimizer
        # tuned for averaged gradients sees them at the same scale.
        size = self._process_set.size()
        if grad is None or not self._scale_local or size == 1:
            return grad
        return backend.divide(grad, size)

    def _is_identity(self):
        # Alone in its set, a rank's average (or sum) is its own gradient:
        # like Horovod, skip the collectives, unless scaling or compression
        # would change the values.
        return (
            self._process_set.size() == 1
            and self._prescale == 1.0
            and self._postscale == 1.0
            and self._compression is Compression.none
        )

    def _partition(self, tensors, variables, backend):
        """Returns (name, indices) of each group of non-`None` tensors, in a fixed order."""
        present = [i for i, t in enumerate(tensors) if t is not None]
        if self._variable_groups is not None:
            return self._partition_by_variables(present, variables)
        if self._num_groups:
            # Consecutive, near-equal shares (Horovod's split_list).
            count, extra = divmod(len(present), self._num_groups)
            bounds = [k * count + min(k, extra) for k in range(self._num_groups + 1)]
            return [
                (f"group{k}", present[bounds[k] : bounds[k + 1]])
                for k in range(self._num_groups)
                if bounds[k] < bounds[k + 1]
            ]
        limit = bucket_bytes()
        if not limit:
            by_dtype = {}
            for i in present:
                by_dtype.setdefault(tensors[i].dtype.name, []).append(i)
            return list(by_dtype.items())
        buckets, current, filled = [], [], 0
        for i in reversed(present):
            nbytes = backend.static_bytes(tensors[i])
            if current and filled + nbytes > limit:
                buckets.append(current)
                current, filled = [], 0
            current.append(i)
            filled += nbytes
        if current:
            buckets.append(current)
        return [(f"bucket{k}", sorted(b)) for k, b in enumerate(buckets)]

    def _partition_by_variables(self, present, variables):
        if variables is None:
            raise ValueError(
                f"keras_ring.{self._api} was given `groups` as lists of variables, so it needs "
                "the variables of the gradients: pass them (optimizer.apply(grads, "
                "trainable_variables) or tape.gradient(target, sources))."
            )
        # Identity, not names: Keras 3 variable names ("kernel") repeat.
        position = {id(variables[i]): i for i in present}
        partition = []
        for k, group in enumerate(self._variable_groups):
            indices = sorted(position.pop(id(v)) for v in group if id(v) in position)
            if indices:
                partition.append((f"group{k}", indices))
        partition.extend((f"grad{i}", [i]) for i in sorted(position.values()))
        return partition
