"""TensorFlowState: TensorFlow variables, kept across an elastic job's resets (Horovod's name)."""

from keras_ring.elastic._variables_state import VariablesState


class TensorFlowState(VariablesState):
    """TensorFlow variables, plus attributes such as the epoch, for a training loop of your own.

    The state of Horovod's `hvd.elastic.TensorFlowState`, for TensorFlow 2's
    eager variables: `save()` (and `commit()`) copies each variable into host
    memory as a NumPy array, with the attributes; `restore()` assigns the copy
    back; `sync()` gives every rank rank 0's variables in one broadcast per
    dtype, then its saved attributes, and saves. For a model's and its
    optimizer's variables, slots included, use `KerasState`.
    Every rank must make the same variables, in the same order, before the
    state. A `tf.function` traced for the old world keeps what it read of it
    (`kr.size()`, say): make it again in a reset callback.

    Args:
        variables: The variables (`tf.Variable`) to keep (a list, or any iterable).
        session: Horovod's TensorFlow 1 session; only `None` is supported
            (eager variables need none).
        **kwargs: Attributes, as for `ObjectState`.

    Raises:
        TypeError: If `variables` is missing or holds something other than
            variables.
        ValueError: If a session is given; from `sync()`, on every rank, if
            the ranks' variables differ.

    Example:

    ```python
    w = tf.Variable(tf.zeros([3, 1]))
    state = kr.elastic.TensorFlowState([w], step=0)

    @kr.elastic.run
    def train(state):
        for state.step in range(state.step, 1000):
            with kr.DistributedGradientTape(tf.GradientTape()) as tape:
                loss = tf.reduce_mean((x @ w - y) ** 2)
            w.assign_sub(0.1 * tape.gradient(loss, w))
            if state.step % 10 == 0:
                state.commit()

    train(state)
    ```
    """

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise ValueError(
                "keras-ring: TensorFlowState keeps TensorFlow 2's eager variables; TensorFlow 1 "
                f"sessions are not supported. Received: session={session!r}")
        if variables is None:
            raise TypeError(
                "keras-ring: TensorFlowState needs the variables to keep (in TensorFlow 2 there "
                "are no global variables to default to): TensorFlowState([w, b], epoch=0). "
                "Received: variables=None")
        self.variables = list(variables)
        for variable in self.variables:
            if not callable(getattr(variable, "assign", None)):
                raise TypeError(
                    "keras-ring: TensorFlowState keeps variables (tf.Variable, or Keras "
                    f"variables). Received: {variable!r} among the variables")
        super().__init__(**kwargs)

    def _variables(self):
        return self.variables
