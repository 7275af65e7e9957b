"""Argument checks of the elastic callbacks."""

from keras_ring.elastic._state import State


def check_state(state, attribute=None):
    """Raises unless `state` is a `State` (with `attribute`, when one is named)."""
    if not isinstance(state, State):
        raise TypeError(
            f"`state` must be a keras_ring.elastic state (KerasState, ObjectState). "
            f"Received: state={state!r}"
        )
    if attribute is not None and not hasattr(state, attribute):
        raise ValueError(
            f"The state has no `{attribute}` attribute: make it with "
            f"kr.elastic.KerasState(model, {attribute}=0, ...). Received: state={state!r}"
        )
