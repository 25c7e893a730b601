"""What the benchmarks of gpu_worker's Engine in the benchmark's own process share:
engines built, warmed and timed (`engines`), the transformers side they are compared with
(`transformers_side`), what the machine allows (`roofline`), bench/engine.py's cases
(`comparison`, `tensor_parallel`, `lora_engine`, `speculative`), random-weight stand-in
models (`stand_ins`) and the sampler before issue 18 (`baseline_sampler`)."""
