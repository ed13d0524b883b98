"""Benchmark the fused linear-CPO loss against its peers and a cuBLAS floor, on the same inputs, in one run.

Implementations (each one function ``(hidden, weight, labels, spec) -> loss``, all in ``IMPLS``):

- ``fused``: ``trl_fused_cpo.fused_linear_cpo_loss(..., backend="triton")`` (``fused-torch``: ``backend="torch"``,
  with ``--fused-torch``; on a CPU it replaces ``fused``; ``fused-lean``: ``memory="lean"``, with ``--impls``).
- ``torch``: what TRL's CPOTrainer does: materialised logits in the inputs' dtype, an fp32 log-softmax, gather,
  per-sequence sums, the CPO sigmoid loss and the NLL from ``CrossEntropyLoss`` over the chosen half's logits.
- ``liger``: ``liger_kernel.chunked_loss.LigerFusedLinearCPOLoss`` (torch.compile, one pair per chunk).
- ``trl-chunked``: ``trl.kernels.ChunkedLogProbFunction`` on the labelled tokens + the same CPO math.
- ``cce``: ``cut_cross_entropy.linear_cross_entropy(reduction="none")`` + the same CPO math.
- ``floor``: cuBLAS doing only the unavoidable products on the labelled tokens (logits, dX, dW; no dW with a
  frozen head; the logits GEMM alone for the forward), on preallocated buffers. ``x floor`` is ms over this,
  measured first at each B; the floor is measured again after the implementations (``floor_after_ms`` in its row,
  printed as the drift), so that a ratio near a target can be read against how far the machine moved.

B counts sequences: B/2 pairs, chosen rows first, T positions each (Liger's CPO benchmark workload). Labels are
already shifted: ``hidden[:, t]`` predicts ``labels[:, t]``. Workloads: ``full`` (all positions labelled, trainable
head, forward + backward), ``masked`` (prompt + padding unlabelled, 40% by default), ``frozen`` and
``frozen-masked`` (head weight without grad, as under LoRA) and ``forward`` (``torch.no_grad()``, nothing needs a
gradient). Peers that are not installed are skipped with one line.

    # H200, default shapes (B = 2,4,8,16, T = 1024, V = 128,256, H = 4096, bf16): about 2 minutes (115 s measured)
    python scripts/benchmark_kernel.py --out outputs/bench_kernel
    # smoke run at tiny shapes, CPU or GPU (on a CPU: fused-torch, torch, trl-chunked, liger, floor):
    python scripts/benchmark_kernel.py --quick --out /tmp/bench_kernel

Writes ``results.json`` (date, device, versions, every number), ``results.csv``, ``time_vs_B.png`` and
``memory_vs_B.png`` under ``--out``. Time is the median of ``triton.testing.do_bench`` on CUDA (of
``time.perf_counter`` on a CPU); peak memory is ``torch.cuda.max_memory_allocated()`` above what was allocated
before the call (the inputs), in GiB, from one separate call. Accuracy (``full`` at ``--accuracy-batch``):
relative errors of the loss and of both gradients against an fp32 reference (the ``torch`` math on the same
bf16 inputs upcast to fp32).
"""

from __future__ import annotations

import argparse
import importlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_common as bc
import torch
import torch.nn.functional as F
from bench_common import error_status, free_memory, sync

import trl_fused_cpo

TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in trl 1.16, what add_fused_lm_head passes
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class LossSpec:
    """The CPO knobs every implementation is called with (sigmoid loss, no label smoothing).

    Attributes:
        beta: CPO temperature.
        cpo_alpha: weight of the chosen-half NLL (0 skips it, as TRL does).
        ignore_index: label of unlabelled positions.
        chunk_bytes: logits-buffer budget of the fused op (None: its default).
    """

    beta: float = 0.1
    cpo_alpha: float = 1.0
    ignore_index: int = -100
    chunk_bytes: int | None = None


@dataclass(frozen=True)
class Workload:
    """One benchmark setting.

    Attributes:
        name: CLI and report name.
        masked: prompt and padding positions carry ``ignore_index``.
        trainable: the head weight requires grad (its gradient is computed).
        backward: forward + backward; False: forward under ``torch.no_grad()`` with no input requiring grad.
        title: one line for the report.
    """

    name: str
    masked: bool
    trainable: bool
    backward: bool
    title: str

    def floor_gemms(self) -> int:
        """How many ``2NVH`` products the floor does: logits, + dX, + dW."""
        return 1 if not self.backward else (3 if self.trainable else 2)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("full", False, True, True, "all positions labelled, trainable head, forward + backward"),
        Workload("masked", True, True, True, "prompt + padding unlabelled, trainable head, forward + backward"),
        Workload("frozen", False, False, True, "all positions labelled, frozen head (LoRA), forward + backward"),
        Workload("frozen-masked", True, False, True, "prompt + padding unlabelled, frozen head, forward + backward"),
        Workload("forward", False, False, False, "all positions labelled, forward only (torch.no_grad)"),
    )
}


# --------------------------------------------------------------------------------------------------------------------
# Implementations: same signature, each returns the scalar loss (mean over pairs of the sigmoid loss + α·NLL).
# --------------------------------------------------------------------------------------------------------------------


def cpo_loss_from_token_logps(
    token_logps: torch.Tensor, mask: torch.Tensor, spec: LossSpec, nll: torch.Tensor | None = None
) -> torch.Tensor:
    """TRL's ``cpo_loss`` (sigmoid, ε = 0) + ``cpo_alpha · nll`` from per-token log-probs.

    Args:
        token_logps: ``[2B, T]`` float32 log-probs of the labels, 0 at unlabelled positions.
        mask: ``[2B, T]`` True where a position is labelled.
        spec: the CPO knobs.
        nll: the chosen-half NLL if the caller computed it its own way; else the token mean of ``-token_logps``
            over the chosen half.

    Returns:
        The scalar loss.
    """
    num_pairs = token_logps.shape[0] // 2
    seq_logps = token_logps.sum(-1)  # sigmoid: summed, not averaged (average_log_prob=False)
    losses = -F.logsigmoid(spec.beta * (seq_logps[:num_pairs] - seq_logps[num_pairs:]))
    if spec.cpo_alpha == 0:
        return losses.mean()
    if nll is None:
        nll = -token_logps[:num_pairs].sum() / mask[:num_pairs].sum().clamp(min=1)
    return losses.mean() + spec.cpo_alpha * nll


def _fused(backend: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec, **kw):
    return trl_fused_cpo.fused_linear_cpo_loss(
        hidden,
        weight,
        labels,
        beta=spec.beta,
        cpo_alpha=spec.cpo_alpha,
        ignore_index=spec.ignore_index,
        backend=backend,
        chunk_bytes=spec.chunk_bytes,
        **kw,
    ).loss


def run_fused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Ours, Triton row passes (CUDA)."""
    return _fused("triton", hidden, weight, labels, spec)


def run_fused_torch(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Ours, the same chunk plan with torch row passes (any device)."""
    return _fused("torch", hidden, weight, labels, spec)


def run_fused_lean(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Ours, ``memory="lean"``: vocabulary slabs, logits twice, no fp32 dW accumulator (a frozen head: as fused)."""
    return _fused("triton", hidden, weight, labels, spec, memory="lean")


def run_torch(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """TRL's CPOTrainer on materialised logits (``concatenated_forward`` → ``get_batch_logps`` → ``cpo_loss``).

    The logits come out of the head in the inputs' dtype (the model output, held through the whole loss as TRL
    holds ``all_logits``); the sequence log-probs come from a log-softmax on an fp32 copy; the NLL is TRL's second
    ``CrossEntropyLoss`` over the chosen half of the model's logits (labels here are already shifted, so no
    ``[:, 1:]``). On fp32 inputs every step is fp32: that is the reference of the accuracy check.

    Measured on the H200 at B = 16 (full workload): 107.7 ms / 27.4 GiB like this; an NLL taken from the same fp32
    log-softmax instead (no second pass, not what TRL does) is 100.3 ms / 23.5 GiB; a CrossEntropyLoss on the fp32
    copy 119.5 ms / 31.3 GiB.
    """
    num_pairs = hidden.shape[0] // 2
    mask = labels != spec.ignore_index
    logits = hidden @ weight.t()  # [2B, T, V]
    token_logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.where(mask, labels, 0).unsqueeze(-1))
    token_logps = token_logps.squeeze(-1) * mask
    nll = None
    if spec.cpo_alpha != 0:
        nll = F.cross_entropy(
            logits[:num_pairs].flatten(0, 1), labels[:num_pairs].flatten(), ignore_index=spec.ignore_index
        ).float()
    return cpo_loss_from_token_logps(token_logps, mask, spec, nll=nll)


def run_liger(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``LigerFusedLinearCPOLoss`` (liger-kernel 0.8.5).

    Its ``forward(lin_weight, _input, target, bias=None)`` takes ``[2B, T, H]`` / ``[2B, T]`` with chosen rows first
    and does not shift the labels (the same convention as ours). ``alpha`` is the NLL weight (``cpo_alpha``); the
    preference loss is summed over pairs and divided by the pair count, the NLL by the chosen half's labelled-token
    count: the same normalisation as TRL. It computes the gradients inside the forward (``torch.func``), one pair
    per chunk, compiled with torch.compile on CUDA (eager elsewhere: inductor on a CPU needs a C++ toolchain).
    """
    from liger_kernel.chunked_loss import LigerFusedLinearCPOLoss

    loss_fn = LigerFusedLinearCPOLoss(
        ignore_index=spec.ignore_index,
        beta=spec.beta,
        alpha=spec.cpo_alpha,
        label_smoothing=0.0,
        compute_nll_loss=spec.cpo_alpha != 0,
        compiled=hidden.is_cuda,
        average_log_prob=False,  # sigmoid CPO sums the token log-probs
        chunk_size=1,
    )
    loss, _aux = loss_fn(weight, hidden, labels)
    return loss


def run_trl_chunked(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``trl.kernels.ChunkedLogProbFunction`` on the labelled tokens, as ``trl.trainer.add_fused_lm_head`` calls it.

    Compacts ``hidden[mask]`` / ``labels[mask]`` (TRL does on Triton devices), scatters the per-token log-probs back
    with ``masked_scatter`` and applies the same CPO math.
    """
    from trl.kernels import ChunkedLogProbFunction

    mask = labels != spec.ignore_index
    # args: hidden, weight, bias, targets, temperature, vocab chunk, softcap, logit_scale, outputs
    per_token = ChunkedLogProbFunction.apply(
        hidden[mask], weight, None, labels[mask], 1.0, TRL_VOCAB_CHUNK, None, 1.0, ("log_probs",)
    )[0]
    token_logps = per_token.new_zeros(mask.shape).masked_scatter(mask, per_token)
    return cpo_loss_from_token_logps(token_logps, mask, spec)


def run_cce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``cut_cross_entropy.linear_cross_entropy(e, c, targets, reduction="none")`` (25.1.1) + the same CPO math.

    ``reduction="none"`` returns the ``[2B, T]`` per-token NLL (fp32, 0 at ``ignore_index``); ``shift=False``
    (labels already shifted); default ``filter_eps="high"`` gradient filter.
    """
    from cut_cross_entropy import linear_cross_entropy

    mask = labels != spec.ignore_index
    nll = linear_cross_entropy(hidden, weight, labels, ignore_index=spec.ignore_index, reduction="none")
    return cpo_loss_from_token_logps(-nll.float(), mask, spec)


@dataclass(frozen=True)
class Impl:
    """A registry entry.

    Attributes:
        fn: the implementation.
        module: what it imports (skipped with one line when that raises ImportError).
        needs_cuda: it has no CPU path.
    """

    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossSpec], torch.Tensor]
    module: str | None
    needs_cuda: bool


IMPLS: dict[str, Impl] = {
    "fused": Impl(run_fused, "triton", needs_cuda=True),
    "fused-torch": Impl(run_fused_torch, None, needs_cuda=False),
    "fused-lean": Impl(run_fused_lean, "triton", needs_cuda=True),
    "torch": Impl(run_torch, None, needs_cuda=False),
    "liger": Impl(run_liger, "liger_kernel.chunked_loss", needs_cuda=False),
    "trl-chunked": Impl(run_trl_chunked, "trl.kernels", needs_cuda=False),
    "cce": Impl(run_cce, "cut_cross_entropy", needs_cuda=True),
}
DEFAULT_IMPLS = ("fused", "torch", "liger", "trl-chunked", "cce")


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why ``IMPLS[name]`` cannot run here (None when it can)."""
    impl = IMPLS[name]
    if impl.needs_cuda and device.type != "cuda":
        return f"needs a CUDA device (running on {device.type})"
    if impl.module is not None:
        try:
            importlib.import_module(impl.module)
        except ImportError as e:
            return f"not installed ({type(e).__name__}: {e})"
    return None


# --------------------------------------------------------------------------------------------------------------------
# Inputs, steps, timing harness
# --------------------------------------------------------------------------------------------------------------------


def make_batch(
    rows: int, args: argparse.Namespace, masked: bool, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``bench_common.make_batch`` at the CLI's shapes: the same inputs for every workload and implementation at one B."""
    shape = (rows, args.seq_len, args.hidden, args.vocab)
    fracs = {"prompt_frac": args.prompt_frac, "pad_frac": args.pad_frac}
    return bc.make_batch(*shape, dtype, device, seed=args.seed, masked=masked, **fracs)


def make_impl_step(
    impl: Impl, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec, workload: Workload
) -> Callable[[], None]:
    """The timed closure: forward + ``backward()`` with the gradients set to None first, or a no-grad forward."""
    if workload.backward:

        def step() -> None:
            hidden.grad = None
            weight.grad = None
            impl.fn(hidden, weight, labels, spec).backward()

    else:

        def step() -> None:
            with torch.no_grad():
                impl.fn(hidden, weight, labels, spec)

    return step


def make_floor_step(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, workload: Workload, ignore_index: int
) -> tuple[Callable[[], None], int]:
    """cuBLAS alone on the labelled tokens: ``[N,H]x[H,V]`` (+ ``[N,V]x[V,H]`` dX, + ``[V,N]x[N,H]`` dW).

    Returns:
        ``(step, flops)``; the buffers are allocated here, outside the timed call.
    """
    x = hidden.detach()[labels != ignore_index].contiguous()  # [N, H]
    w = weight.detach()
    logits = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)  # doubles as dlogits
    dx = torch.empty_like(x) if workload.backward else None
    dw = torch.empty_like(w) if workload.backward and workload.trainable else None

    def step() -> None:
        torch.mm(x, w.t(), out=logits)
        if dx is not None:
            torch.mm(logits, w, out=dx)
        if dw is not None:
            torch.mm(logits.t(), x, out=dw)

    return step, 2 * x.shape[0] * w.shape[0] * w.shape[1] * workload.floor_gemms()


def time_ms(step: Callable[[], None], device: torch.device, args: argparse.Namespace) -> float:
    """Median ms of ``step`` at the CLI's ``--warmup`` / ``--rep`` (``--cpu-reps`` without CUDA)."""
    return bc.time_ms(step, device, warmup=args.warmup, rep=args.rep, cpu_reps=args.cpu_reps)


def measure(
    step: Callable[[], None],
    device: torch.device,
    args: argparse.Namespace,
    grads_of: Sequence[torch.Tensor],
    memory: bool = True,
) -> dict[str, Any]:
    """First call (compile/autotune included), median time and peak memory of one entry; OOM and errors recorded."""
    out: dict[str, Any] = {"ms": None, "peak_gib": None, "first_call_s": None, "status": "ok"}
    failed = False
    try:
        t0 = time.perf_counter()
        step()
        sync(device)
        out["first_call_s"] = time.perf_counter() - t0
        out["ms"] = time_ms(step, device, args)
        if memory:
            out["peak_gib"] = bc.peak_gib(step, device, grads_of)
    except Exception as e:  # one failing peer must not end the run
        out["status"] = error_status(e)
        failed = True
    free_memory(device, grads_of, collect=failed)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------------------------


def measure_floor(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    workload: Workload,
    spec: LossSpec,
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], int]:
    """The floor's entry (``measure``'s dict, no peak: its buffers are preallocated) and its FLOP count."""
    try:
        floor_step, flops = make_floor_step(hidden, weight, labels, workload, spec.ignore_index)
        floor = measure(floor_step, device, args, (), memory=False)
        del floor_step
    except Exception as e:  # e.g. the floor's buffers do not fit
        floor, flops = {"ms": None, "peak_gib": None, "first_call_s": None, "status": error_status(e)}, 0
    free_memory(device, collect=floor["status"] != "ok")
    return floor, flops


def run_workload(
    workload: Workload,
    impls: Sequence[str],
    weight: torch.Tensor,
    args: argparse.Namespace,
    spec: LossSpec,
    dtype: torch.dtype,
    device: torch.device,
) -> list[dict[str, Any]]:
    """Every B of one workload: the floor first, then each implementation on the same inputs, then the floor again."""
    rows = []
    weight.requires_grad_(workload.trainable)
    for batch in args.batch_sizes:
        hidden, labels = make_batch(batch, args, workload.masked, dtype, device)
        hidden.requires_grad_(workload.backward)
        labelled = int((labels != spec.ignore_index).sum())
        common = {"workload": workload.name, "B": batch, "positions": batch * args.seq_len, "labelled": labelled}

        floor, flops = measure_floor(hidden, weight, labels, workload, spec, device, args)
        floor["tflops"] = flops / floor["ms"] / 1e9 if floor["ms"] else None
        floor_row = {**common, "impl": "floor", **floor, "x_floor": 1.0 if floor["ms"] else None}
        rows.append(floor_row)
        print_entry(floor_row)

        for name in impls:
            step = make_impl_step(IMPLS[name], hidden, weight, labels, spec, workload)
            res = measure(step, device, args, (hidden, weight))
            del step
            res["tflops"] = flops / res["ms"] / 1e9 if res["ms"] else None  # floor-equivalent rate
            res["x_floor"] = res["ms"] / floor["ms"] if res["ms"] and floor["ms"] else None
            rows.append({**common, "impl": name, **res})
            print_entry(rows[-1])
        # The floor again after the implementations: how far the machine drifted over this B (recorded only; × floor
        # stays over the first measurement, taken before any implementation ran).
        if floor["ms"]:  # a floor that failed (its buffers did not fit) is not tried a second time
            floor_row["floor_after_ms"] = measure_floor(hidden, weight, labels, workload, spec, device, args)[0]["ms"]
        if floor_row.get("floor_after_ms"):
            print(f"  {workload.name:<14} B={batch:<3d} floor again  {floor_row['floor_after_ms']:.2f} ms "
                  f"({floor_row['floor_after_ms'] / floor['ms'] - 1:+.1%} drift)")  # fmt: skip
        del hidden, labels
        free_memory(device, (weight,), collect=False)
    return rows


def rel_err(value: torch.Tensor | None, ref: torch.Tensor) -> float | None:
    """``‖value − ref‖ / ‖ref‖`` in float32 (the weight gradient is 0.5 G elements at Llama-3 shapes)."""
    if value is None:
        return None
    ref = ref.detach().float()
    return float((value.detach().float() - ref).norm() / ref.norm().clamp(min=1e-30))


def run_accuracy(
    impls: Sequence[str],
    weight: torch.Tensor,
    args: argparse.Namespace,
    spec: LossSpec,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """``full`` workload at ``--accuracy-batch``: loss and gradient errors against the fp32 ``torch`` math."""
    batch = args.accuracy_batch
    hidden, labels = make_batch(batch, args, False, dtype, device)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    h32 = hidden.detach().float().requires_grad_(True)
    w32 = weight.detach().float().requires_grad_(True)
    ref_loss = run_torch(h32, w32, labels, spec)
    ref_loss.backward()
    ref_loss, ref_gh, ref_gw = ref_loss.detach(), h32.grad, w32.grad
    del h32, w32
    free_memory(device, collect=False)
    out: dict[str, Any] = {"workload": "full", "B": batch, "reference": "fp32 torch math", "loss_ref": float(ref_loss)}
    for name in impls:
        try:
            hidden.grad = weight.grad = None
            loss = IMPLS[name].fn(hidden, weight, labels, spec)
            loss.backward()
            out[name] = {
                "status": "ok",
                "loss": float(loss.detach()),
                "loss_rel_err": rel_err(loss, ref_loss),
                "grad_hidden_rel_err": rel_err(hidden.grad, ref_gh),
                "grad_weight_rel_err": rel_err(weight.grad, ref_gw),
            }
            del loss
        except Exception as e:
            out[name] = {"status": error_status(e)}
        free_memory(device, (hidden, weight), collect=out[name]["status"] != "ok")
    del ref_gh, ref_gw
    free_memory(device, collect=False)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or a dash as wide as ``spec`` asks when there is no value."""
    if value is None:
        width = re.match(r"\d*", spec).group()
        return "-".rjust(int(width)) if width else "-"
    return format(value, spec)


def print_entry(row: dict[str, Any]) -> None:
    extra = f"  ({row['tflops']:.1f} TFLOP/s)" if row["impl"] == "floor" and row.get("tflops") else ""
    status = "" if row["status"] == "ok" else f"  [{row['status']}]"
    print(
        f"  {row['workload']:<14} B={row['B']:<3} {row['impl']:<12} {fmt(row['ms'], '9.2f')} ms  "
        f"x{fmt(row['x_floor'], '.2f')}  peak {fmt(row['peak_gib'], '.2f')} GiB  "
        f"first call {fmt(row['first_call_s'], '.1f')} s{extra}{status}",
        flush=True,
    )


def print_table(workload: Workload, rows: list[dict[str, Any]]) -> None:
    print(f"\n== {workload.name}: {workload.title} ==")
    print(f"{'impl':<12} {'B':>3} {'labelled':>9} {'ms':>9} {'x floor':>8} {'peak GiB':>9}  status")
    for row in rows:
        print(
            f"{row['impl']:<12} {row['B']:>3} {row['labelled']:>9} {fmt(row['ms'], '9.2f')} "
            f"{fmt(row['x_floor'], '8.2f')} {fmt(row['peak_gib'], '9.2f')}  {row['status']}"
        )


def print_accuracy(acc: dict[str, Any], impls: Sequence[str]) -> None:
    print(f"\n== accuracy: {acc['workload']}, B={acc['B']}, relative error vs {acc['reference']} ==")
    print(f"{'impl':<12} {'loss':>10} {'grad hidden':>12} {'grad weight':>12}  status")
    for name in impls:
        r = acc[name]
        print(
            f"{name:<12} {fmt(r.get('loss_rel_err'), '10.2e')} {fmt(r.get('grad_hidden_rel_err'), '12.2e')} "
            f"{fmt(r.get('grad_weight_rel_err'), '12.2e')}  {r['status']}"
        )


def write_results(out_dir: Path, report: dict[str, Any]) -> None:
    """``results.json`` (everything) and ``results.csv`` (one line per workload × impl × B)."""
    bc.write_json(out_dir / "results.json", report)
    fields = ["workload", "impl", "B", "positions", "labelled", "ms", "x_floor", "peak_gib", "tflops", "first_call_s"]
    fields.append("floor_after_ms")  # the floor's row: the floor measured again after the implementations
    bc.write_csv(out_dir / "results.csv", report["results"], [*fields, "status"])


def plot_results(out_dir: Path, rows: list[dict[str, Any]], workloads: Sequence[str], impls: Sequence[str]) -> None:
    """``time_vs_B.png`` and ``memory_vs_B.png``: one subplot per workload, one line per implementation."""
    plt = bc.pyplot()
    if plt is None:
        return
    for key, ylabel, filename, with_floor in (
        ("ms", "ms (median)", "time_vs_B.png", True),
        ("peak_gib", "peak GiB above inputs", "memory_vs_B.png", False),
    ):
        fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8), squeeze=False)
        for ax, wname in zip(axes[0], workloads, strict=True):
            for name in (["floor"] if with_floor else []) + list(impls):
                pts = [(r["B"], r[key]) for r in rows if r["workload"] == wname and r["impl"] == name and r[key]]
                if not pts:
                    continue
                pts.sort()
                xs, ys = [b for b, _ in pts], [v for _, v in pts]
                style = {"color": "black", "linestyle": "--"} if name == "floor" else {}
                ax.plot(xs, ys, marker="o", label=name, **style)
            ax.set_title(wname)
            ax.set_xlabel("B (sequences)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["B"] for r in rows}), [str(b) for b in sorted({r["B"] for r in rows})])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        handles, labels = axes[0][0].get_legend_handles_labels()
        for ax in axes[0][1:]:
            h, lab = ax.get_legend_handles_labels()
            if len(h) > len(handles):
                handles, labels = h, lab
        if handles:
            fig.legend(handles, labels, loc="upper center", ncol=len(handles), frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.9))
        fig.savefig(out_dir / filename, dpi=120)
        plt.close(fig)


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The CLI; ``--quick`` only changes the defaults of the shapes it names and shortens ``do_bench``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", type=str, default=None, help="sequences per batch, even (default 2,4,8,16)")
    p.add_argument("--seq-len", type=int, default=None, help="T (default 1024)")
    p.add_argument("--vocab", type=int, default=None, help="V (default 128256)")
    p.add_argument("--hidden", type=int, default=None, help="H (default 4096)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--workloads", type=str, default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    p.add_argument("--impls", type=str, default=",".join(DEFAULT_IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--fused-torch", action="store_true", help="also time fused_linear_cpo_loss(backend='torch')")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--cpo-alpha", type=float, default=1.0)
    p.add_argument("--chunk-bytes", type=int, default=None, help="the fused op's logits budget (default: its own)")
    p.add_argument("--prompt-frac", type=float, default=0.25, help="masked: unlabelled prefix of each row")
    p.add_argument("--pad-frac", type=float, default=0.15, help="masked: unlabelled suffix of each row")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed calls per entry without CUDA")
    p.add_argument("--accuracy-batch", type=int, default=2, help="B of the accuracy check")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--device", type=str, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("outputs/bench_kernel"))
    p.add_argument("--quick", action="store_true", help="smoke run: V=4096, H=256, T=128, B=2 unless given")
    args = p.parse_args(argv)

    shape_defaults = {"batch_sizes": "2", "seq_len": 128, "vocab": 4096, "hidden": 256} if args.quick else {}
    shape_defaults = {"batch_sizes": "2,4,8,16", "seq_len": 1024, "vocab": 128256, "hidden": 4096, **shape_defaults}
    for key, value in shape_defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.warmup, args.rep = min(args.warmup, 10), min(args.rep, 20)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    if any(b < 2 or b % 2 for b in args.batch_sizes):
        p.error(f"--batch-sizes must be even and >= 2 (B/2 chosen rows, then B/2 rejected); got {args.batch_sizes}")
    if args.accuracy_batch < 2 or args.accuracy_batch % 2:
        p.error("--accuracy-batch must be even and >= 2")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for kind, chosen, known in (("workload", args.workloads, WORKLOADS), ("impl", args.impls, IMPLS)):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            p.error(f"unknown {kind}(s) {unknown}; choose from {list(known)}")
    if not 0 <= args.prompt_frac + args.pad_frac < 1:
        p.error("--prompt-frac + --pad-frac must be in [0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return the report that was written to ``<out>/results.json``.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = bc.pick_device(args.device)
    dtype = DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    spec = LossSpec(beta=args.beta, cpo_alpha=args.cpo_alpha, chunk_bytes=args.chunk_bytes)

    wanted = list(args.impls)
    if "fused-torch" not in wanted and (args.fused_torch or ("fused" in wanted and device.type != "cuda")):
        wanted.insert(
            wanted.index("fused") + 1 if "fused" in wanted else 0, "fused-torch"
        )  # on a CPU, in fused's place
    impls, skipped = [], {}
    for name in wanted:
        reason = unavailable_reason(name, device)
        if reason is None:
            impls.append(name)
        else:
            skipped[name] = reason
            print(f"skip {name}: {reason}")
    if "liger" in impls:  # Liger recompiles per grad mode and B; don't let dynamo fall back to eager silently
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))

    record = bc.run_record(device)
    print(
        f"device {record['device']}; B={args.batch_sizes} T={args.seq_len} V={args.vocab} H={args.hidden} {args.dtype}; "
        f"impls {impls}; workloads {args.workloads}",
        flush=True,
    )
    report: dict[str, Any] = {
        **record,
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "spec": asdict(spec),
            "timer": "triton.testing.do_bench median" if device.type == "cuda" else "time.perf_counter median",
        },
        "impls": impls,
        "skipped": skipped,
        "accuracy": None,
        "results": [],
    }

    weight = bc.make_weight(args.vocab, args.hidden, dtype, device, args.seed)
    if not args.no_accuracy:
        report["accuracy"] = run_accuracy(impls, weight, args, spec, dtype, device)
        print_accuracy(report["accuracy"], impls)
        write_results(args.out, report)

    for wname in args.workloads:
        workload = WORKLOADS[wname]
        print(f"\n-- {wname}: {workload.title}", flush=True)
        rows = run_workload(workload, impls, weight, args, spec, dtype, device)
        report["results"].extend(rows)
        print_table(workload, rows)
        write_results(args.out, report)  # after each workload: a run cut short keeps what it measured

    report["wall_s"] = time.perf_counter() - t_start
    write_results(args.out, report)
    if not args.no_plots:
        plot_results(args.out, report["results"], args.workloads, impls)
    print(
        f"\nwrote {args.out}/results.json, results.csv" + ("" if args.no_plots else ", time_vs_B.png, memory_vs_B.png")
    )
    print(f"total {report['wall_s']:.1f} s")
    return report


if __name__ == "__main__":
    main()
