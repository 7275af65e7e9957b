"""The reduce ops, numbered as horovod's.

Kept apart from the TensorFlow ops so that code using only the engine (and
machines without TensorFlow) can name them.
"""

Average = 0
Sum = 1
# Horovod's Adasum: the name exists so that Horovod scripts import, and every
# use is refused (`refuse_adasum`).
Adasum = 2
Min = 3
Max = 4
Product = 5

# The ops keras-ring offers.
NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max", Product: "Product"}


def refuse_adasum(op):
    """Raises if `op` is `Adasum`, which keras-ring does not offer.

    Args:
        op: The reduce op a caller was given.

    Raises:
        NotImplementedError: If `op` is `keras_ring.Adasum`.
    """
    if op is not True and op == Adasum:
        raise NotImplementedError(
            "Adasum is not offered by keras-ring: use op=keras_ring.Average (the default), "
            "which averages the ranks' values. Received: op=Adasum"
        )
