"""Shared fixtures. Without CUDA, Triton kernels run through the interpreter (set before any kernel import)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402

from trl_fused_cpo.ops.cpo_math import CPOHyperparams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's tensors: CUDA, or the CPU through the interpreter


def make_batch(
    rows: int,
    seq_len: int,
    hidden_size: int,
    vocab: int,
    *,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    prompt_frac: float = 0.3,
    seed: int = 0,
    logit_std: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [rows, T, H], weight [V, H], bias [V], labels [rows, T] with a prompt mask and ragged padding.

    Logits have std ≈ ``logit_std`` (never zeros: they hide indexing errors).
    """
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, seq_len, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) * (logit_std / hidden_size**0.5)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1
    labels = torch.randint(0, vocab, (rows, seq_len), generator=g)
    for r in range(rows):
        prompt = int(prompt_frac * seq_len * torch.rand((), generator=g).item())
        pad = int(0.3 * seq_len * torch.rand((), generator=g).item())
        labels[r, :prompt] = -100
        if pad:
            labels[r, seq_len - pad :] = -100
    to = dict(dtype=dtype, device=device)
    return hidden.to(**to), weight.to(**to), bias.to(**to), labels.to(device)


# The TF32 switches transformers' enable_tf32 flips: torch >= 2.9's fp32_precision, else (torch 2.8, which the bounds
# admit) the legacy allow_tf32 flags. One API only: torch refuses a process that has mixed them.
if hasattr(torch.backends, "fp32_precision"):
    _TF32_KNOBS = [
        (obj, "fp32_precision")
        for obj in (torch.backends, torch.backends.cuda.matmul, torch.backends.cudnn)
        if hasattr(obj, "fp32_precision")
    ]
else:
    _TF32_KNOBS = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]


@pytest.fixture(autouse=True)
def restore_tf32():
    """Put the process-wide TF32 switches back after every test.

    ``TrainingArguments(torch_compile=True, bf16=True)`` turns TF32 on for the whole process (transformers'
    ``enable_tf32``); on a GPU every fp32 test after it would then run TF32 GEMMs and miss its 1e-5 budget.
    """
    saved = [getattr(obj, name) for obj, name in _TF32_KNOBS]
    yield
    for (obj, name), value in zip(_TF32_KNOBS, saved, strict=True):
        setattr(obj, name, value)


@pytest.fixture
def batch_factory():
    return make_batch


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package).

    ``scripts/`` goes on ``sys.path`` first, as ``python scripts/<name>.py`` puts it, so that a script's
    ``import bench_common`` finds its sibling.
    """
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    path = scripts / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


OPTIONS = [
    dict(loss_type="sigmoid"),
    dict(loss_type="sigmoid", label_smoothing=0.2, beta=0.3),
    dict(loss_type="sigmoid", cpo_alpha=0.0),
    dict(loss_type="hinge", beta=0.05),
    dict(loss_type="ipo", beta=0.5),
    dict(loss_type="simpo", simpo_gamma=0.8, beta=2.0),
    dict(loss_type="simpo", cpo_alpha=0.5, label_smoothing=0.1),
    dict(loss_type="alphapo", alpha=0.25, beta=2.5),
    dict(loss_type="sigmoid", alpha=0.05),
    dict(loss_type="ipo", alpha=-0.3),
]


def trl_reference(hidden, weight, bias, labels, **opts):
    """TRL 1.16's CPOTrainer math, called on materialised float64 logits (labels unshifted, as TRL takes them)."""
    hp = CPOHyperparams.create(**opts)
    fake = SimpleNamespace(
        beta=hp.beta,
        loss_type=hp.loss_type,
        label_smoothing=hp.label_smoothing,
        simpo_gamma=hp.simpo_gamma,
        alpha=hp.alpha,
        accelerator=SimpleNamespace(device=hidden.device),
    )
    logits = hidden.double() @ weight.double().t() + bias.double()
    # TRL shifts inside get_batch_logps: our labels[:, t] is its labels[:, t + 1], so it never scores our last
    # position, which the trainer always leaves unlabelled.
    assert (labels[:, -1] == -100).all()
    trl_labels = torch.nn.functional.pad(labels, (1, 0), value=-100)[:, :-1]
    logps = CPOTrainer.get_batch_logps(logits, trl_labels, average_log_prob=hp.average_log_prob)
    b = hidden.shape[0] // 2
    losses, cr, rr = CPOTrainer.cpo_loss(fake, logps[:b], logps[b:])
    if hp.cpo_alpha == 0:
        nll = torch.zeros((), dtype=torch.float64)
    else:
        nll = torch.nn.functional.cross_entropy(
            logits[:b].reshape(-1, logits.shape[-1]), labels[:b].reshape(-1), ignore_index=-100
        )
    return hp, losses.mean() + hp.cpo_alpha * nll, logps[:b], logps[b:], cr, rr, nll
