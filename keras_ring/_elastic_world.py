"""The worker's side of the elastic protocol (temporary: the lead's version replaces this file)."""


def hosts_updated():
    """Returns True when the driver asked the world to re-form; False outside an elastic job."""
    return False
