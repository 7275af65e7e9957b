"""The backend-free core: the engine binding, init, the topology, process sets, objects,
the host collectives on NumPy arrays, the timeline's recording and the rank's side of an
elastic world.

Nothing here imports Keras or a framework, and nothing here imports the layers above it
(the adapters, the Keras layer, elastic, the launcher). `keras_ring` re-exports the
public names.
"""
