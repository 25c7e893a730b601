"""Gemma 2 (HF `Gemma2ForCausalLM`, GGUF `gemma2`): the shared Gemma decoder
(`gpu_worker.models.gemma`) with Llama's attention as configured: scores scaled by
`query_pre_attn_scalar ** -0.5` and soft-capped (`attn_logit_softcapping`), local
(sliding-window) and global layers alternating (`ModelConfig.layer_windows`)."""

from __future__ import annotations

from gpu_worker.models.gemma import GemmaDefaults, GemmaForCausalLM


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 2B/9B/27B."""

    # Gemma2Config's: odd layers local, even global, no local rope base of their own.
    config_defaults = GemmaDefaults(
        rope_theta=10000.0,
        rope_local_theta=None,
        sliding_period=2,
        sliding_period_key=None,
        logit_softcaps=(50.0, 30.0),
        num_layers_27b=46,
    )
