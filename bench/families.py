"""Decode speed per model family: duet's Engine against transformers, same run.

For each family a random-weight model with the family's own features (Qwen3's q/k norms,
Phi-3's fused projections, partial rotary and LongRoPE, Mixtral's and Qwen3-MoE's routed
experts, Gemma's local layers and softcaps) is built with transformers' config class, saved
with `save_pretrained` and loaded by both systems from that directory. Shapes are one
~100M-parameter dense size that a 2-core CPU decodes in seconds; the MoE models keep the
dense model's attention and give each token the same number of active MLP parameters as the
dense one (Mixtral: 8 experts of half the width, top 2; Qwen3-MoE: 16 of a quarter, top 4),
so their per-active-parameter rate compares directly with the dense rate.

Only decode is timed: both sides prefill the batch first (untimed), then run `--steps`
greedy steps. duet: `Engine.step` until every request has its first token, then the clock
runs over the remaining steps. transformers: one forward over the batch with a
`DynamicCache`, then a loop of one-token forwards and argmax (what `generate` does, without
its per-step logits processing). Passes alternate between the two systems, `--repeats`
times; rates are over the median pass, in wall time and in process CPU time (one torch
thread by default, so CPU time is what a contended core does not inflate).

    python -m bench.families                         # every family, writes RESULTS.md
    python -m bench.families --model qwen3 --no-write
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from bench.common.machine import load_average
from bench.common.results_md import command_line, write_section
from bench.common.timing import Clock
from gpu_worker import Engine
from gpu_worker.models import MODEL_REGISTRY
from shared.protocol import Generate
from shared.sampling import SamplingParams

# The dense size every family shares (Llama-style, untied, 32k vocabulary).
DENSE: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,  # Qwen3Config has none by default; the Engine wants one
)
# Phi-4-mini's traits: 3/4 of each head rotates, LongRoPE past an original context. The
# prompts stay under it, so both systems use the short factors (duet with max_model_len
# below the original context, transformers by sequence length).
PHI3_ROTARY = 48  # 0.75 * head_dim 64
PHI3: dict[str, Any] = dict(
    partial_rotary_factor=0.75,
    original_max_position_embeddings=4096,
    max_position_embeddings=131072,
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0 + i / PHI3_ROTARY for i in range(PHI3_ROTARY // 2)],
        "long_factor": [1.0 + 8 * i / PHI3_ROTARY for i in range(PHI3_ROTARY // 2)],
    },
    pad_token_id=None,  # Phi3Config's default pad id is past a 32000 vocabulary
)
FAMILIES: dict[str, tuple[type[transformers.PretrainedConfig], dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=64)),
    "phi3": (transformers.Phi3Config, PHI3),
    "mixtral": (
        transformers.MixtralConfig,
        dict(intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512),
    ),
    # Gemma's traits: tied embeddings scaled by sqrt(hidden), GeLU-tanh MLP, sandwich norms,
    # local layers with a window shorter than the prompts (Gemma 2: every other layer, with
    # logit and attention softcapping; Gemma 3: 5 of 6, q/k norms, their own rope base).
    "gemma2": (
        transformers.Gemma2Config,
        dict(head_dim=64, sliding_window=64, query_pre_attn_scalar=64, tie_word_embeddings=True),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(head_dim=64, sliding_window=64, query_pre_attn_scalar=64, tie_word_embeddings=True),
    ),
}
# Each MoE family against the dense family it extends, for the per-active-parameter line.
MOE_VS_DENSE = {"mixtral": "llama", "qwen3_moe": "qwen3"}
ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def build_model(family: str, out_dir: Path, seed: int) -> transformers.PreTrainedModel:
    """A random fp32 model of `family` saved to `out_dir` with a one-token-per-id
    tokenizer.json (the Engine identifies its vocabulary by that file)."""
    from tokenizers import Tokenizer, models

    config_cls, extra = FAMILIES[family]
    # transformers writes into a rope dict it is given: each model gets its own copy.
    extra = {k: dict(v) if isinstance(v, dict) else v for k, v in extra.items()}
    config = config_cls(**{**DENSE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(out_dir / "tokenizer.json"))
    return model


def parameter_counts(model: transformers.PreTrainedModel) -> tuple[int, int]:
    """(all parameters, parameters one token's decode multiplies by): the input embedding
    is a lookup, and a routed expert tensor counts for top_k / num_experts of its size."""
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    share = cfg.num_experts_per_tok / experts if experts else 1.0
    total = active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if "embed_tokens" in name:
            # Tied, the same matrix is the LM head, which every token multiplies by.
            active += param.numel() if cfg.tie_word_embeddings else 0
            continue
        active += round(param.numel() * (share if ".experts." in name else 1.0))
    return total, active


def prompts(seed: int, batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids past the first few, so no prompt holds the eos id by accident.
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


@torch.inference_mode()
def hf_decode(model: Any, batch: list[list[int]], steps: int) -> Clock:
    """Clock of `steps` greedy decode steps after an untimed prefill."""
    out = model(torch.tensor(batch), past_key_values=transformers.DynamicCache(), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    start = Clock.now()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return Clock.now() - start


def duet_decode(engine: Engine, batch: list[list[int]], steps: int) -> Clock:
    """Clock of the engine steps after every request got its first token (prefill)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine.reset_prefix_cache()
    for i, prompt in enumerate(batch):
        engine.add_request(Generate(request_id=f"r{i}", prompt_token_ids=prompt, sampling=params))
    started: set[str] = set()
    while len(started) < len(batch):
        started.update(d.request_id for d in engine.step())
    produced = 0
    start = Clock.now()
    while engine.has_unfinished_requests():
        produced += len(engine.step())
    elapsed = Clock.now() - start
    assert produced == steps * len(batch), (produced, steps, len(batch))
    return elapsed


@dataclass
class Case:
    """Decode clocks of one family at one concurrency, per pass and system."""

    family: str
    concurrency: int
    tokens: int
    theirs: list[Clock] = field(default_factory=list)
    ours: list[Clock] = field(default_factory=list)

    def rate(self, clocks: list[Clock], attr: str = "wall") -> float:
        return self.tokens / statistics.median(getattr(c, attr) for c in clocks)

    def ratio(self, attr: str = "wall") -> float:
        return self.rate(self.ours, attr) / self.rate(self.theirs, attr)


def run_family(family: str, args: argparse.Namespace) -> tuple[list[Case], tuple[int, int]]:
    with tempfile.TemporaryDirectory(prefix=f"duet-bench-{family}-") as tmp:
        hf = build_model(family, Path(tmp), args.seed)
        counts = parameter_counts(hf)
        cases: list[Case] = []
        for concurrency in args.concurrency:
            engine = Engine(
                model=tmp,
                device="cpu",
                dtype="float32",
                max_num_seqs=concurrency,
                max_model_len=1024,
                # The whole batch prefills in one step, so every later step is pure decode.
                max_num_batched_tokens=max(2048, concurrency * args.prompt_len),
                kv_cache_memory_gb=0.5,
            )
            vocab = hf.config.vocab_size
            warm = prompts(-1, concurrency, 16, vocab)  # first-call costs, both sides
            hf_decode(hf, warm, 2)
            duet_decode(engine, warm, 2)
            case = Case(family, concurrency, concurrency * args.steps)
            for rep in range(args.repeats):
                batch = prompts(args.seed + rep, concurrency, args.prompt_len, vocab)
                # Alternate who goes first, so a slow stretch of the machine is shared.
                for ours in (False, True) if rep % 2 == 0 else (True, False):
                    if ours:
                        case.ours.append(duet_decode(engine, batch, args.steps))
                    else:
                        case.theirs.append(hf_decode(hf, batch, args.steps))
                print(
                    f"  {family} x{concurrency} pass {rep}: transformers "
                    f"{case.tokens / case.theirs[-1].wall:.1f} tok/s, duet "
                    f"{case.tokens / case.ours[-1].wall:.1f} tok/s",
                    flush=True,
                )
            cases.append(case)
            del engine
            gc.collect()
        del hf
        gc.collect()
    return cases, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        nargs="+",
        choices=list(FAMILIES),
        default=None,
        help="families to measure (default: every one gpu_worker's registry serves)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="passes per system and case")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # transformers 5.2x renames forward's `past_key_values` to `cache`; the old name is the
    # one every supported version (>= 4.45) takes.
    warnings.filterwarnings("ignore", ".*past_key_values.*deprecated", FutureWarning)
    # The one-token-per-id tokenizer has no decoder llguidance knows; no request here is
    # structured, so its "structured outputs unavailable" traceback is noise.
    logging.getLogger("gpu_worker.sampling.structured").setLevel(logging.CRITICAL)
    if args.model is None:
        args.model = [f for f in FAMILIES if ARCHITECTURE[f] in MODEL_REGISTRY]
    missing = [f for f in args.model if ARCHITECTURE[f] not in MODEL_REGISTRY]
    if missing:
        raise SystemExit(f"not in gpu_worker's registry: {missing}")

    load_at_start, started = load_average(), time.perf_counter()
    results: dict[str, tuple[list[Case], tuple[int, int]]] = {}
    for family in args.model:
        results[family] = run_family(family, args)
    rows = [
        "| family | params (active per token) | concurrency | transformers tok/s "
        "| duet tok/s | duet / transformers (wall) | duet / transformers (CPU time) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for family, (cases, (total, active)) in results.items():
        for case in cases:
            rows.append(
                f"| {family} | {total / 1e6:.0f}M ({active / 1e6:.0f}M) | {case.concurrency} "
                f"| {case.rate(case.theirs):.1f} | {case.rate(case.ours):.1f} "
                f"| **{case.ratio():.2f}x** | {case.ratio('cpu'):.2f}x |"
            )
    moe_rows = moe_lines(results)
    print("\n".join(rows + [""] + moe_rows), flush=True)
    if args.no_write:
        return
    body = [
        "## Model families (bench/families.py)",
        "",
        f"`{command_line()}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {args.threads} torch thread(s); load "
        f"average {load_at_start} at the start, {load_average()} at the end; "
        f"{time.perf_counter() - started:.0f} s in all.",
        "",
        f"Random-weight fp32 models (see the script's docstring for shapes), {args.prompt_len}-"
        f"token random prompts, {args.steps} timed greedy decode steps per sequence after an "
        "untimed prefill. duet: `Engine` (torch backend, paged KV cache, continuous "
        "batching); transformers: one-token forwards with a `DynamicCache`. "
        f"Median of {args.repeats} alternating passes per system, in wall and process CPU "
        "time. MoE lines: the MoE model's decode rate times its active parameters per token "
        "(input embedding excluded, routed experts at top_k / num_experts) over the same for "
        "the dense family it extends; the issue's bar is at least 0.5.",
        "",
        *rows,
        "",
        *moe_rows,
    ]
    write_section("families", "\n".join(body))


def moe_lines(results: dict[str, tuple[list[Case], tuple[int, int]]]) -> list[str]:
    """MoE decode rate times active parameters, over the same for its dense family (the bar:
    above 0.5, i.e. not more than 2x slower per active parameter)."""
    lines = [
        "| MoE vs dense | concurrency | duet: (tok/s x active) / dense's (wall) | duet (CPU time) "
        "| transformers (wall) | transformers (CPU time) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for moe, dense in MOE_VS_DENSE.items():
        if moe not in results or dense not in results:
            continue
        (moe_cases, (_, moe_active)), (dense_cases, (_, dense_active)) = (
            results[moe],
            results[dense],
        )
        for m, d in zip(moe_cases, dense_cases, strict=True):
            cells = [
                m.rate(clocks(m), attr) * moe_active / (d.rate(clocks(d), attr) * dense_active)
                for clocks in (lambda c: c.ours, lambda c: c.theirs)
                for attr in ("wall", "cpu")
            ]
            lines.append(
                f"| {moe} vs {dense} | {m.concurrency} | **{cells[0]:.2f}** | {cells[1]:.2f} "
                f"| {cells[2]:.2f} | {cells[3]:.2f} |"
            )
    return lines


if __name__ == "__main__":
    main()
