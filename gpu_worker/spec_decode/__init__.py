"""Speculative decoding: the configuration and the drafters that propose tokens for the
target model to verify (issue 21).

`config` parses `--speculative-config` (vLLM's JSON). `ngram` (prompt lookup) and `suffix`
(suffix decoding over the request and recent outputs) are model-free drafters: pure
Python/numpy, no torch, so their tests assert exact proposals in milliseconds.
"""
