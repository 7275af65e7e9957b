"""The Keras layer, written once over `keras.ops`: `DistributedOptimizer`, the callbacks,
`SyncBatchNormalization`, data sharding and `kr.evaluate`.

What differs per Keras backend is in `_backends`; everything outside the compiled train
step goes through the core's host collectives. `keras_ring` re-exports the public names.
"""
