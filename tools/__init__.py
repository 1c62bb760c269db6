"""Developer tools that are neither roles nor benchmarks: the cluster-scale simulator (tools/simulator/)."""
