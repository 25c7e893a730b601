"""Tensor parallelism: the TP group (`group`), its collectives (`comm`), how weights split
(`sharding`), the parallel layer types built on them (`layers`) and `parallelize`, which
swaps them into a built model (the loader then reads each rank's slices)."""
