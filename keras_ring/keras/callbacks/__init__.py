"""The Keras callbacks, one module each; `keras_ring.callbacks` is their public face."""
