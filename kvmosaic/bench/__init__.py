"""Benchmarks against peers: workloads, peers in worker processes, the interleaved runner,
summaries, the markdown report and the plots (``kvmosaic bench``)."""
