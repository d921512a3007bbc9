"""What every long-lived process of a pod shares: the metrics, the heap, the may-I-block rule."""
