"""What the benchmarks, the profiler and the checkpoint maker share: run records, timing, memory, output, inputs.

``benchmark_kernel.py``, ``benchmark_e2e.py``, ``profile_fused_op.py`` and ``make_random_checkpoint.py`` import it
as a sibling module (``python scripts/<name>.py`` puts ``scripts/`` on ``sys.path``; so does the tests'
``load_script``). Four concerns, one section each:

- the run record: date, device and package versions, and the commit measured (``TRL_FUSED_CPO_COMMIT`` wins over
  ``git``: the GPU machine's copy of the repository may carry a stale ``.git``);
- timing and memory: ``triton.testing.do_bench`` medians on CUDA (``time.perf_counter`` medians on a CPU, so every
  script also runs at toy sizes in the CPU tests), peak memory above the inputs, OOM detection;
- output: JSON, CSV and matplotlib (skipped with one line when it is not installed);
- inputs: the kernel benchmark's hidden states, head weight and labels (logits of std ≈ 2, never zeros), and the
  end-to-end benchmark's Llama-3 shapes, word-level tokenizer and synthetic preference pairs.
"""

from __future__ import annotations

import csv
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # else tokenizers warns when a dataloader forks after it ran
try:
    import trl_fused_cpo
except ImportError:  # a checkout without `pip install -e .`; kernel-ab puts ab/<rev> on PYTHONPATH instead
    sys.path.insert(0, str(ROOT))
    import trl_fused_cpo

GIB = float(1 << 30)
PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "tokenizers",
    "liger-kernel",
    "cut-cross-entropy",
)


# --------------------------------------------------------------------------------------------------------------------
# The run record
# --------------------------------------------------------------------------------------------------------------------


def package_versions() -> dict[str, str | None]:
    """Python, this package (version, where it was imported from, commit) and every package a script may use."""
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "trl_fused_cpo": trl_fused_cpo.__version__,
        # kernel-ab imports ab/<rev>/trl_fused_cpo: the path says which copy ran
        "trl_fused_cpo_path": str(Path(trl_fused_cpo.__file__).resolve().parent),
    }
    for dist in PACKAGES:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    versions["torch_cuda"] = torch.version.cuda
    versions["git"] = os.environ.get("TRL_FUSED_CPO_COMMIT") or git_commit()
    return versions


def git_commit() -> str | None:
    """``git rev-parse --short HEAD`` of this checkout, or None without git."""
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return rev.stdout.strip() or None


def device_info(device: torch.device) -> dict[str, Any]:
    """Name, and on CUDA the capability, memory and device count."""
    if device.type != "cuda":
        return {"name": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", "cuda": False}
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "cuda": True,
        "capability": f"{props.major}.{props.minor}",
        "total_memory_gib": props.total_memory / GIB,
        "count": torch.cuda.device_count(),
    }


def run_record(device: torch.device) -> dict[str, Any]:
    """The header every results file starts with: ``date`` (UTC), ``device`` (its name), ``device_info``, ``versions``."""
    info = device_info(device)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": info["name"],
        "device_info": info,
        "versions": package_versions(),
    }


def pick_device(name: str | None) -> torch.device:
    """``name`` (None or "auto": CUDA when there is one), with the CUDA index made explicit and set current."""
    if name in (None, "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is None:  # set_device and the memory counters want an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


# --------------------------------------------------------------------------------------------------------------------
# Timing and memory
# --------------------------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the GPU (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    step: Callable[[], object], device: torch.device, *, warmup: int = 25, rep: int = 200, cpu_reps: int = 3
) -> float:
    """Median ms of ``step``: ``do_bench(warmup=ms, rep=ms)`` on CUDA; one untimed then ``cpu_reps`` timed calls else."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(step, warmup=warmup, rep=rep, return_mode="median"))
    step()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_gib(step: Callable[[], object], device: torch.device, grads_of: Sequence[torch.Tensor] = ()) -> float | None:
    """Peak allocated memory of one call above what was allocated before it (the inputs), in GiB; None off CUDA.

    The gradients of ``grads_of`` are dropped first: left over from an earlier call they would count as inputs.
    """
    if device.type != "cuda":
        return None
    for t in grads_of:
        t.grad = None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / GIB


def free_memory(device: torch.device, grads_of: Sequence[torch.Tensor] = (), collect: bool = True) -> None:
    """Drop the gradients and hand cached blocks back, so one run's leftovers never count in the next one's peak.

    ``collect``: ``gc.collect()`` first (0.2 s with dynamo imported; needed after an exception, whose traceback
    cycles hold tensors).
    """
    for t in grads_of:
        t.grad = None
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """Out of device memory, as torch raises it or as cuBLAS / cuDNN report a failed allocation."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text or "CUDNN_STATUS_ALLOC_FAILED" in text
    )


def error_status(exc: BaseException) -> str:
    """``"OOM"``, or the exception's type and first line, for a results file."""
    if is_oom(exc):
        return "OOM"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


# --------------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------------


def write_json(path: Path | str, obj: Any) -> None:
    """``obj`` as indented JSON (anything JSON cannot hold, e.g. a Path, as its ``str``), the folder made first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def write_csv(path: Path | str, rows: Iterable[dict[str, Any]], fields: Sequence[str]) -> None:
    """One line per row, the named fields in order (others left out, missing ones empty)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (with one printed line) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"skip plots: matplotlib not installed ({e})")
        return None
    return plt


# --------------------------------------------------------------------------------------------------------------------
# Inputs of the kernel benchmark and the profiler: Liger's CPO workload, B sequences × T positions
# --------------------------------------------------------------------------------------------------------------------


def make_weight(vocab: int, hidden_size: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """``[V, H]`` head weight ~ N(0, (2/√H)²): with N(0, 1) hidden states the logits have std ≈ 2."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=gen, device=device, dtype=torch.float32)
    return weight.mul_(2.0 / hidden_size**0.5).to(dtype)


def make_batch(
    rows: int,
    seq_len: int,
    hidden_size: int,
    vocab: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    seed: int = 0,
    masked: bool = False,
    prompt_frac: float = 0.25,
    pad_frac: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [rows, T, H] ~ N(0, 1)`` and labels uniform in ``[0, V)``, the same for every workload at one B.

    Masked: the first ``prompt_frac`` of each row's positions (the prompt) and the last ``pad_frac`` (padding) are
    ``-100`` (40% unlabelled by default).
    """
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rows)
    hidden = torch.randn(rows, seq_len, hidden_size, generator=gen, device=device, dtype=torch.float32).to(dtype)
    labels = torch.randint(0, vocab, (rows, seq_len), generator=gen, device=device)
    if masked:
        labels[:, : round(prompt_frac * seq_len)] = -100
        labels[:, seq_len - round(pad_frac * seq_len) :] = -100
    return hidden, labels


# --------------------------------------------------------------------------------------------------------------------
# Inputs of the end-to-end benchmark and the checkpoint maker: Llama-3 shapes, a tokenizer, preference pairs
# --------------------------------------------------------------------------------------------------------------------

LLAMA3_VOCAB = 128_256
LLAMA3_BOS, LLAMA3_EOS, LLAMA3_PAD, LLAMA3_UNK = 128_000, 128_001, 128_004, 128_002
CONTENT_VOCAB = 128_000  # content ids stay below the special/reserved range

_LLAMA32_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LORA_ALL_LINEAR = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
# Llama-3 family shapes (config.json of the public checkpoints); the weights are random.
MODELS: dict[str, dict] = {
    "toy": {"toy": True, "lora": None, "max_length": 128},
    "llama3.2-1b": {
        "config": dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            tie_word_embeddings=True,
            max_position_embeddings=131_072,
            rope_parameters=_LLAMA32_ROPE,
        ),
        "lora": None,  # full fine-tune
        "label": "Llama-3.2-1B, full fine-tune",
    },
    "llama3.2-3b": {
        "config": dict(
            hidden_size=3072,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=8192,
            tie_word_embeddings=True,
            max_position_embeddings=131_072,
            rope_parameters=_LLAMA32_ROPE,
        ),
        "lora": LORA_ALL_LINEAR,
        "label": "Llama-3.2-3B, LoRA r=16 all linear",
    },
    "llama3-8b": {
        "config": dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14_336,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        ),
        "lora": LORA_ALL_LINEAR,
        "label": "Llama-3-8B, LoRA r=16 all linear",
    },
    # Llama-3.1-8B: Llama-3-8B's widths with 3.1's RoPE scaling (factor 8 over 8,192) to 131,072 positions.
    "llama3.1-8b": {
        "config": dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14_336,
            tie_word_embeddings=False,
            max_position_embeddings=131_072,
            rope_parameters={**_LLAMA32_ROPE, "factor": 8.0},
        ),
        "lora": LORA_ALL_LINEAR,
        "label": "Llama-3.1-8B, LoRA r=16 all linear",
    },
    # QLoRA recipe's shape: checkpoint_only (scripts/make_random_checkpoint.py --layers N writes a depth-reduced
    # copy; 80 bf16 layers do not fit one GPU, and the benchmarks build bf16 models).
    "llama3.1-70b": {
        "config": dict(
            hidden_size=8192,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=28_672,
            tie_word_embeddings=False,
            max_position_embeddings=131_072,
            rope_parameters={**_LLAMA32_ROPE, "factor": 8.0},
        ),
        "lora": LORA_ALL_LINEAR,
        "label": "Llama-3.1-70B (QLoRA recipe's shape)",
        "checkpoint_only": True,
    },
}

_TOKENIZER_CACHE: dict[str, object] = {}


def synthetic_tokenizer():
    """A fast tokenizer whose text ``"t5 t17"`` is ids ``[5, 17]``, over Llama 3's 128,256 ids (built once)."""
    if "llama3" not in _TOKENIZER_CACHE:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {f"t{i}": i for i in range(LLAMA3_VOCAB)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=f"t{LLAMA3_UNK}"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        _TOKENIZER_CACHE["llama3"] = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=f"t{LLAMA3_BOS}",
            eos_token=f"t{LLAMA3_EOS}",
            pad_token=f"t{LLAMA3_PAD}",
            unk_token=f"t{LLAMA3_UNK}",
        )
    return _TOKENIZER_CACHE["llama3"]


def synthetic_pairs(
    n: int,
    seed: int,
    prompt_len: tuple[int, int] = (100, 400),
    completion_len: tuple[int, int] = (100, 600),
    worst_case: bool = False,
) -> list[dict[str, str]]:
    """``n`` preference rows of random content tokens; lengths uniform in the ranges (the maxima if worst_case)."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(f"t{rng.randrange(CONTENT_VOCAB)}" for _ in range(k))

    def length(lo_hi: tuple[int, int]) -> int:
        return lo_hi[1] if worst_case else rng.randint(*lo_hi)

    rows = []
    for _ in range(n):
        prompt = words(length(prompt_len))
        # The leading space keeps "prompt + chosen" splitting at the boundary (TRL tokenizes the concatenation).
        rows.append(
            {
                "prompt": prompt,
                "chosen": " " + words(length(completion_len)),
                "rejected": " " + words(length(completion_len)),
            }
        )
    return rows


def toy_pairs(n: int, worst_case: bool = False) -> list[dict[str, str]]:
    """``n`` rows of the shipped toy preferences, cycled (worst_case: the longest row, repeated)."""
    from trl_fused_cpo.toy import load_toy_preferences

    rows = load_toy_preferences("train")
    if worst_case:
        rows = sorted(rows, key=lambda r: -(len(r["prompt"]) + max(len(r["chosen"]), len(r["rejected"]))))[:1]
    return [rows[i % len(rows)] for i in range(n)]


def build_model(
    name: str, device: torch.device, seed: int, attn_implementation: str | None = None, num_layers: int | None = None
):
    """A random-init model of the named shape, built directly on ``device`` (bf16; the toy model fp32 on a CPU), with
    ``attn_implementation`` (None: transformers' default, sdpa); ``num_layers`` keeps only that many decoder layers
    (every other width as named: per-layer memory, measured at two depths, extrapolates to the full one)."""
    from trl_fused_cpo.varlen_attention import register

    register()  # attn_implementation fused_cpo_varlen (+attn=fused_cpo_varlen) is known before the model is built
    torch.manual_seed(seed)
    spec = MODELS[name]
    if spec.get("toy"):
        from trl_fused_cpo.toy import toy_model

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = toy_model(seed=seed, dtype=dtype).to(device)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        return model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=LLAMA3_VOCAB,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=LLAMA3_BOS,
        eos_token_id=LLAMA3_EOS,
        pad_token_id=LLAMA3_PAD,
        **{**spec["config"], **({"num_hidden_layers": num_layers} if num_layers else {})},
    )
    config.dtype = torch.bfloat16
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn_implementation)


def tokenizer_for(name: str):
    """The toy tokenizer for ``toy``, else the synthetic Llama-3-id tokenizer."""
    if MODELS[name].get("toy"):
        from trl_fused_cpo.toy import toy_tokenizer

        return toy_tokenizer()
    return synthetic_tokenizer()


# Length profiles (tokens, uniform in each range; prompt + completion + bos + eos <= max_length, nothing truncated).
# APPROXIMATE shapes, not token counts of the real sets (the GPU machine reaches no hub):
# - synthetic: the benchmark's original lengths.
# - ultrafeedback: short single-turn instructions, longer answers. Its dataset card (HuggingFaceH4/
#   ultrafeedback_binarized: 61,135 train pairs) publishes no token statistics; the ranges are an assumption of
#   that shape (prompt 20-300, completions 100-700), to be replaced by a token count of the real set.
# - capybara: multi-turn, the earlier turns in the prompt. Its card (LDJnr/Capybara) states an average context of
#   "over 1,000 tokens" and "3 turns or more": prompt 400-1,600 (mean 1,000), completions 150-440, max_length 2048.
LENGTH_PROFILES: dict[str, dict] = {
    "synthetic": {"prompt_len": (100, 400), "completion_len": (100, 600), "max_length": 1024},
    "ultrafeedback": {"prompt_len": (20, 300), "completion_len": (100, 700), "max_length": 1024},
    "capybara": {"prompt_len": (400, 1600), "completion_len": (150, 440), "max_length": 2048},
}


def rows_for(
    name: str, n: int, seed: int, worst_case: bool = False, profile: str = "synthetic"
) -> list[dict[str, str]]:
    """``n`` preference rows that the model ``name``'s tokenizer reads, of the length ``profile``."""
    if MODELS[name].get("toy"):
        return toy_pairs(n, worst_case=worst_case)
    lengths = LENGTH_PROFILES[profile]
    return synthetic_pairs(
        n, seed, prompt_len=lengths["prompt_len"], completion_len=lengths["completion_len"], worst_case=worst_case
    )


# --------------------------------------------------------------------------------------------------------------------
# The distance to the limit: unique-token MFU, the cuBLAS rate beside it, the profiled step by kernel class
# --------------------------------------------------------------------------------------------------------------------

DENSE_BF16_PEAK = 989e12  # H100 SXM and H200, dense bf16 FLOP/s (the datasheets' figure without sparsity)


def non_embedding_params(model) -> int:
    """Parameters of the backbone less the embedding and the head (and any LoRA adapter): DESIGN's N_nonembed."""
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if not any(key in name for key in ("embed_tokens", "lm_head", "lora_"))
    )


def unique_token_flops(
    *, n_nonembed: int, layers: int, hidden: int, vocab: int, unique: int, attn_sq: int, labelled: int, frozen: bool
) -> float:
    """FLOPs of one micro-batch, each pair counted once and nothing recomputed: the backbone ``K·N`` a unique
    position (K = 6 full fine-tune, 4 frozen base), causal attention ``6·L·d·((P+C)² + (P+R)² - P²)`` a pair
    (``attn_sq`` sums the brackets), the head ``K·V·H`` a labelled token."""
    k = 4 if frozen else 6
    return k * n_nonembed * unique + 6 * layers * hidden * attn_sq + k * vocab * hidden * labelled


def cublas_bf16_tflops(device: torch.device, n: int = 8192) -> float | None:
    """The ``n³`` bf16 matmul rate on this GPU, this process (None off CUDA): what the card gives a plain GEMM."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = time_ms(lambda: a @ b, device, warmup=100, rep=500)
    return 2 * n**3 / (ms * 1e-3) / 1e12


# Kernel classes, by name (lower case), the first match wins: attention before GEMM (cuDNN's and CUTLASS's fmha
# kernels carry "gemm"-like tiles in their names), the fused head's Triton kernels by their function names.
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optimizer", ("multi_tensor_apply", "adam", "lpnorm", "fused_optimizer")),
    ("attention", ("flash", "fmha", "sdpa", "flex_attention", "attention", "attn")),
    (
        "head",
        (
            "_softmax_grad_kernel",
            "_segment_stats_kernel",
            "_combine_kernel",
            "_pair_tail_kernel",
            "_finish_kernel",
            "_label_counts_kernel",
            "_compact_labels_kernel",
            "_scale_cast_kernel",
            "_rescale_kernel",
            "_shifted_exp",
            "_frozen_dx_kernel",
        ),
    ),  # fmt: skip
    ("gemm", ("gemm", "nvjet", "cublas", "cutlass", "xmma", "splitk", "matmul", "_mm_", "triton_tem_fused_mm")),
    ("copy", ("memcpy", "memset", "nccl")),
)
STEP_PARTS = ("gemm", "attention", "elementwise", "head", "optimizer", "copy", "idle")


def kernel_class(name: str, scopes: Sequence[str] = ()) -> str:
    """The class of a GPU kernel: ``head`` or ``optimizer`` when launched inside the fused op's autograd Function
    (``LinearCPOFunction``, forward and backward: its cuBLAS GEMMs too) or an ``Optimizer.step`` (``scopes``: the
    names of the CPU ops around the launch), else by the kernel's name; anything unmatched is ``elementwise``
    (norms, RoPE, SiLU, adds, casts, reductions, Inductor's fused pointwise kernels)."""
    if any("LinearCPOFunction" in s for s in scopes):
        return "head"
    if any(s.startswith("Optimizer.") for s in scopes):
        return "optimizer"
    lower = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(key in lower for key in keys):
            return cls
    return "elementwise"


def step_breakdown(prof, step_ms: float) -> dict[str, float]:
    """Milliseconds of one profiled step per kernel class, and ``idle`` = step time less the GPU's busy time (the
    kernels' summed durations: one stream). Kernels are found on the CPU ops that launched them (``.kernels``)."""
    parts = dict.fromkeys(STEP_PARTS, 0.0)
    for event in prof.events():
        for kernel in getattr(event, "kernels", ()) or ():
            if kernel.name == event.name or kernel.name.startswith(("Optimizer.", "ProfilerStep")):
                continue  # a range annotation mirrored on the GPU's timeline, not a kernel: its kernels count apart
            scopes, parent = [], event
            while parent is not None:
                scopes.append(parent.name)
                parent = parent.cpu_parent
            parts[kernel_class(kernel.name, scopes)] += kernel.duration / 1e3
    busy = sum(v for k, v in parts.items() if k != "idle")
    parts["idle"] = max(step_ms - busy, 0.0)
    parts["busy"] = busy
    return parts
