"""The TensorFlow adapter: the engine's collectives as TensorFlow ops, built on first use
against the installed TensorFlow.

Its public names are `keras_ring`'s own (`kr.allreduce`, `kr.broadcast_variables`, ...).
"""
