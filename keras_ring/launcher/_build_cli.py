"""`keras-ring-build`: builds the adapter of every installed framework ahead of time."""

import importlib
import importlib.util
import sys

# The framework's package, its name and the module that builds its adapter.
_ADAPTERS = (
    ("tensorflow", "TensorFlow", "keras_ring.tensorflow._build"),
    ("jax", "JAX", "keras_ring.jax._build"),
)


def main():
    """Builds (or finds cached) each installed framework's adapter and says where it is."""
    found = False
    for package, framework, module in _ADAPTERS:
        if importlib.util.find_spec(package) is None:
            continue
        found = True
        builder = importlib.import_module(module)
        builder.load()
        print(f"keras-ring: {framework} adapter at {builder.library_path()}")
    if not found:
        sys.exit("keras-ring-build: neither TensorFlow nor JAX is installed; install "
                 '"keras-ring[tensorflow]" or "keras-ring[jax]"')
