"""Collectives over whole pytrees: a model's gradients or its parameters."""

import jax

from keras_ring.core import _basics
from keras_ring.core._process_sets import global_process_set
from keras_ring.jax._ops import _array, _broadcast_arrays, grouped_allreduce


def allreduce_gradients(tree, op=None, compression=None, prescale_factor=1.0,
                        postscale_factor=1.0, name="gradients", process_set=global_process_set):
    """Reduces every array of a pytree (by default, averages) as one group.

    One custom call, one agreement between the ranks and as few fused
    transfers as the engine's fusion threshold allows, whatever the number
    of leaves. Arguments as `allreduce`; `name` must differ between groups
    that are in flight at once.

    Args:
        tree: A pytree of arrays, such as the gradients `jax.grad` returns.

    Returns:
        A pytree of the same structure with the reduced arrays.

    Example:

    ```python
    @jax.jit
    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        grads = krj.allreduce_gradients(grads)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    ```
    """
    leaves, treedef = jax.tree.flatten(tree)
    reduced = grouped_allreduce(leaves, op=op, compression=compression,
                                prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, name=name,
                                process_set=process_set)
    return jax.tree.unflatten(treedef, reduced)


def broadcast_parameters(tree, root_rank=0, name="parameters", process_set=global_process_set):
    """Gives every rank `root_rank`'s arrays of a pytree (its parameters, say).

    Args:
        tree: A pytree of arrays, the same structure and shapes on every rank.
        root_rank: The rank (of the job) whose arrays every rank receives.
        name: The name of the broadcast; leaf `i` is `<name>.<i>`.

    Returns:
        A pytree of the same structure with the root's arrays.

    Example:

    ```python
    params = init_params(jax.random.key(krj.rank()))  # different on every rank
    params = krj.broadcast_parameters(params, root_rank=0)
    ```
    """
    _basics._require_initialized("broadcast_parameters()")
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    # One custom call for every leaf (leaf i is named `<name>.<i>`).
    arrays = [_array(leaf, "broadcast_parameters") for leaf in leaves]
    received = _broadcast_arrays(arrays, root_rank, name, process_set, "broadcast_parameters")
    return jax.tree.unflatten(treedef, received)
