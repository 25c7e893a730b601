"""Tensor parallelism: the TP group (`group`), its collectives (`comm`), how weights split
(`sharding`) and the parallel layer types built on them (`layers`)."""
