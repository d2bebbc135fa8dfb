"""Support shared by the tests and the benchmarks (and by a learner's runs of them).

- ``models``: tiny random models built in-process (never downloaded), and mlx-lm's model
  class of the same family loaded with the same weights (the model oracle);
- ``runs``: greedy parameters, a request served alone (the batching oracle), staggered
  arrivals, random workloads, a model wrapper that records logits;
- ``devices``: tests by device (the ``cpu_device`` and ``gpu_decisions`` fixtures);
- ``paged``: paged-attention cases over shuffled, poisoned pools, and the dense references
  (plain MLX ops at float32, numpy at float64) every paged walk is checked against.
"""
