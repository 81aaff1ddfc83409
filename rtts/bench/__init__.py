"""``rtts bench``: the benchmarks, run against a real server over real sockets."""
