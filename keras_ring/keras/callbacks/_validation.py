"""Argument checks shared by the callbacks: they name the argument and what was received."""

import numbers


def check_number(name, value, positive=False):
    """Raises ValueError unless `value` is a real number (and positive, if asked)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a number. Received: {name}={value!r}")
    if positive and not value > 0:
        raise ValueError(f"`{name}` must be positive. Received: {name}={value!r}")


def check_integer(name, value, minimum):
    """Raises ValueError unless `value` is an integer of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer of at least {minimum}. Received: {name}={value!r}"
        )
