"""The reduce ops, numbered as horovod's (2 was Adasum, which keras-ring does not offer).

Kept apart from the TensorFlow ops so that code using only the engine (and
machines without TensorFlow) can name them.
"""

Average = 0
Sum = 1
Min = 3
Max = 4
Product = 5

NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max", Product: "Product"}
