"""Training: the loop (loop.py: train, evaluate), the `pretrain` command (pretrain.py), batches to
the device (batch.py), metrics and MFU (metrics.py, flops.py), timers, loss plots
(plot.py), and `gigatron quickstart` (quickstart.py).

Nothing is imported here, so that `gigatron quickstart --help` or the metrics tools load only
what they use.
"""
