"""End to end: TRL's stock ``CPOTrainer`` against ``FusedCPOTrainer`` on Llama-3-shaped models, same config and batches.

For each model shape and micro-batch (pairs per device) it builds a random-init bf16 model on the GPU, a synthetic
pre-tokenizable preference dataset with realistic lengths, and runs ``--warmup`` + ``--steps`` optimizer steps of
each trainer with an identical ``CPOConfig`` (TRL defaults otherwise: gradient checkpointing on, bf16). It reports
the median step time, labelled tok/s (completion tokens of chosen and rejected, EOS included), all tok/s (non-pad
tokens), peak GPU memory (``max_memory_allocated``, reset before each run, weights and optimizer state included) and
the loss of every step, then writes ``results.json`` and the plots into ``--out``.

    python scripts/benchmark_e2e.py --model llama3.2-1b                      # 2 + 6 steps x 2 trainers x mb 2,4,8
    python scripts/benchmark_e2e.py --model llama3-8b --micro-batches 2,4,8
    python scripts/benchmark_e2e.py --model llama3.2-1b --find-max-batch     # largest micro-batch per trainer
    python scripts/benchmark_e2e.py --model llama3.2-1b --curve-steps 20     # + a 20-step loss-curve comparison
    python scripts/benchmark_e2e.py --model toy --micro-batches 2 --steps 2  # CPU smoke test (CI)
    python scripts/benchmark_e2e.py --model llama3.2-1b --micro-batches 8 --warmup 3 \
        --variants stock,fused,fused+liger,fused+compile,fused+liger+compile   # what the kernels buy

Variants: ``stock`` (TRL's CPOTrainer) or ``fused`` (FusedCPOTrainer), each optionally with ``+liger``
(``use_liger_kernel=True``: Liger's RMSNorm, SwiGLU and RoPE kernels on the backbone), ``+compile``
(``torch_compile=True``: Accelerate's ``torch.compile(model)``; FusedCPOTrainer's head stays eager behind one graph
break) or ``+compile-regional`` (the same with ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1``: each decoder layer
compiled once and reused, a shorter cold start). Compilation happens in the warm-up steps (the first compiles, the
second recompiles for a new sequence length): give compiled variants ``--warmup 3``; ``warmup_s`` in results.json
is what the warm-up cost. Each run restores what Liger patches in ``modeling_llama`` and resets Dynamo, so a variant
never leaks into the next; results.json is rewritten after every run, so a call cut off keeps what finished.
``fused+padfree`` and ``fused+prefix`` run the packed batch layouts (``batch_layout`` ``padding_free`` /
``prefix_shared``) with flex_attention's BlockMask on the GPU; ``+sdpa`` gives them the dense mask through sdpa
instead (which GPU path wins). ``dynamo_graphs`` in results.json counts the graphs each run compiled; ``--profile``
adds one untimed step per run under torch.profiler and keeps its top kernels (``profile_top``) and the step by kernel
class (``step_breakdown_ms``: GEMM, attention, elementwise, head, optimizer, copy, idle). ``+act=<policy>`` sets
FusedCPOConfig's ``activation_policy`` (``none``, ``full``, ``auto``, ``offload`` or a number of layers; a fused
variant without it keeps TRL's blanket checkpointing, as before the knob existed) and ``+attn=<name>`` any
``attn_implementation`` (e.g. ``fused+prefix+act=none+attn=fused_cpo_varlen``). Every run records
``unique_token_mfu`` (each pair's unique tokens once, no recompute counted, over 989 TFLOP/s) beside the 8192³ cuBLAS
rate of the same process; ``--lengths ultrafeedback|capybara`` draws approximate lengths of those sets.

Data (``bench_common.py``, shared with ``make_random_checkpoint.py``). ``CPOTrainer.__init__`` always runs ``tokenize_row`` over the text columns (there is no pre-tokenized input
path), so the text is made to tokenize to known ids: an in-process ``tokenizers`` WordLevel tokenizer over the 128,256
words ``t0`` ... ``t128255`` (bos ``t128000``, eos ``t128001``, pad ``t128004``, as Llama 3's ids) maps the text
``"t5 t17 ..."`` to ``[5, 17, ...]`` at ~1 ms per 1,000 tokens. Content ids are drawn below 128,000 so no text ever
contains a special token. Prompts have 100-400 tokens and completions 100-600 (uniform), so prompt + completion + bos +
eos <= 1,002 <= ``max_length`` = 1,024 and nothing is truncated. Both trainers get the same rows, the same seed and so
the same sampler order; the collator (TRL's own ``DPODataCollatorWithPadding``, wrapped to count tokens) records every
batch, and ``results.json`` says whether both trainers saw identical batches.

Timing. A ``TrainerCallback`` brackets each optimizer step (``on_step_begin`` .. ``on_step_end``: forward, backward,
clip, optimizer step; the batch fetch is outside) with ``torch.cuda.synchronize()`` + ``perf_counter``. step s is the
median over the timed steps; tok/s is tokens over time summed over the timed steps (batches differ in length).
"padded tok/s" counts the [2B, T] positions the model runs, padding included (results.json has all three). Before the
measured runs of a model, each trainer runs 2 untimed steps once (``--no-process-warmup`` skips it) so one-time costs
(cuBLAS/SDPA first calls, Triton JIT of the fused kernels) stay out of the first measured run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import bench_common as bc
import torch
from bench_common import GIB, MODELS, build_model, free_memory, is_oom, rows_for, tokenizer_for

from trl_fused_cpo.packing import pack_pairs

TRAINERS = ("stock", "fused")  # the trainers; a variant is one of them plus options, e.g. "fused+liger+compile"
OPTIONS = ("liger", "compile", "compile-regional", "padfree", "prefix", "sdpa")
LAYOUTS = {"padfree": "padding_free", "prefix": "prefix_shared"}  # option -> FusedCPOConfig.batch_layout


VALUED = ("act", "attn")  # +act=<activation_policy> (fused), +attn=<attn_implementation>: any value, passed through


def valued_option(options: frozenset[str], key: str) -> str | None:
    """The value of ``+key=value`` among ``options``, or None."""
    return next((o.split("=", 1)[1] for o in options if o.startswith(key + "=")), None)


def parse_variant(variant: str) -> tuple[str, frozenset[str]]:
    """``"fused+liger+compile"`` -> ``("fused", {"liger", "compile"})``; ValueError for anything else."""
    base, *options = variant.split("+")
    plain = [o for o in options if "=" not in o]
    valued = [o.split("=", 1) for o in options if "=" in o]
    keys = [k for k, _ in valued]
    if (
        base not in TRAINERS
        or not set(plain) <= set(OPTIONS)
        or len(set(options)) < len(options)
        or not set(keys) <= set(VALUED)
        or len(set(keys)) < len(keys)
        or any(not v for _, v in valued)
    ):
        raise ValueError(
            f"variant {variant!r}: one of {TRAINERS}, then any of {['+' + o for o in OPTIONS]} and "
            "+act=<none|full|auto|offload|k>, +attn=<attn_implementation>"
        )
    if "act" in keys:
        from trl_fused_cpo.activations import check_policy

        check_policy(valued_option(frozenset(options), "act"))
        if base == "stock":
            raise ValueError(f"variant {variant!r}: +act= is FusedCPOConfig's activation_policy, a fused option")
    if {"compile", "compile-regional"} <= set(options):
        raise ValueError(f"variant {variant!r}: +compile or +compile-regional, not both")
    if len(set(LAYOUTS) & set(options)) > 1 or (base == "stock" and set(LAYOUTS) & set(options)):
        raise ValueError(f"variant {variant!r}: at most one batch layout (+padfree, +prefix), on the fused trainer")
    if "sdpa" in options and not set(LAYOUTS) & set(options):
        raise ValueError(f"variant {variant!r}: +sdpa picks the packed layouts' attention: add +padfree or +prefix")
    return base, frozenset(options)


# ----------------------------------------------------------------------------------------------------------- data


class CountingCollator:
    """TRL's ``DPODataCollatorWithPadding`` (what CPOTrainer builds by default), recording each batch's token counts."""

    def __init__(self, pad_token_id: int):
        from trl.experimental.utils import DPODataCollatorWithPadding

        self.inner = DPODataCollatorWithPadding(pad_token_id=pad_token_id, is_encoder_decoder=False)
        self.pad_token_id = pad_token_id
        self.batches: list[dict[str, int]] = []

    def __call__(self, features):
        batch = self.inner(features)
        labelled = nonpad = 0
        for side in ("chosen", "rejected"):
            labelled += int((batch[f"{side}_labels"] != -100).sum())
            nonpad += int(batch[f"{side}_attention_mask"].sum())
        seq = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
        pairs = int(batch["chosen_input_ids"].shape[0])
        # padded = the [2B, T] positions the model actually runs (CPOTrainer pads chosen and rejected to one T);
        # padding_free / prefix_shared = the positions of the same pairs packed (before flex's 128-block tail)
        counts = {"pairs": pairs, "labelled": labelled, "nonpad": nonpad, "padded": 2 * pairs * seq}
        # each pair once: P + C + R unique positions, and the attention's visible pairs (P+C)² + (P+R)² - P²
        p = batch["prompt_attention_mask"].sum(1)
        c, r = batch["chosen_attention_mask"].sum(1), batch["rejected_attention_mask"].sum(1)
        counts["unique"] = int((c + r - p).sum())
        counts["attn_sq"] = int((c * c + r * r - p * p).sum())
        for layout in ("padding_free", "prefix_shared"):
            counts[layout] = pack_pairs(batch, layout, pad_token_id=self.pad_token_id).num_tokens
        self.batches.append(counts)
        return batch


# ---------------------------------------------------------------------------------------------------------- model


def peft_config_for(name: str):
    lora = MODELS[name]["lora"]
    if lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **lora)


# ------------------------------------------------------------------------------------------------------- running


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def make_step_timer(device: torch.device):
    from transformers import TrainerCallback

    sync = _cuda(device)

    class StepTimer(TrainerCallback):
        """perf_counter around each optimizer step, the GPU drained on both sides; peak memory after each step."""

        def __init__(self):
            self.times: list[float] = []
            self.peaks_gib: list[float] = []
            self._t0 = None

        def on_step_begin(self, args, state, control, **kwargs):
            if sync:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if sync:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)
            if sync:
                self.peaks_gib.append(torch.cuda.max_memory_allocated() / GIB)

    return StepTimer()


def make_step_profiler(device: torch.device, step: int, top: int = 20):
    """torch.profiler around optimizer step ``step`` (1-based; the run's last, kept out of the timing): the kernels
    the GPU ran in it by total time (on a CPU, the operators), so a table shows which attention kernels run."""
    from transformers import TrainerCallback

    cuda = _cuda(device)

    class StepProfiler(TrainerCallback):
        def __init__(self):
            self.prof = None
            self.kernels: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:  # global_step counts the steps already finished
                activities = [torch.profiler.ProfilerActivity.CPU]
                if cuda:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is None or self.kernels:
                return
            if cuda:
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.kernels = _top_events(self.prof, cuda, top)

    return StepProfiler()


def _top_events(prof, cuda: bool, top: int) -> list[dict]:
    from torch.autograd import DeviceType

    def total_us(event) -> float:
        if not cuda:
            return event.self_cpu_time_total
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)

    events = [e for e in prof.key_averages() if (e.device_type == DeviceType.CUDA) == cuda and total_us(e) > 0]
    events.sort(key=total_us, reverse=True)
    return [{"name": e.key[:160], "ms": total_us(e) / 1e3, "calls": e.count} for e in events[:top]]


def trainer_class(kind: str):
    kind, _ = parse_variant(kind)
    if kind == "stock":
        from trl.experimental.cpo import CPOTrainer

        return CPOTrainer
    if kind == "fused":
        from trl_fused_cpo import FusedCPOTrainer

        return FusedCPOTrainer
    raise ValueError(f"trainer {kind!r} is not one of {TRAINERS}")


def make_config(
    output_dir: str,
    *,
    micro_batch: int,
    max_steps: int,
    args,
    device: torch.device,
    max_length: int,
    options: frozenset[str] = frozenset(),
):
    from trl.experimental.cpo import CPOConfig

    from trl_fused_cpo import FusedCPOConfig

    layout = next((LAYOUTS[o] for o in options if o in LAYOUTS), None)
    policy = valued_option(options, "act")
    config_cls, extra = (FusedCPOConfig, {"batch_layout": layout or "padded"}) if layout or policy else (CPOConfig, {})
    if policy:  # FusedCPOConfig's activation_policy decides (auto: from the memory)
        extra["activation_policy"] = policy
    elif config_cls is FusedCPOConfig:  # TRL's blanket checkpointing, as the variant meant before +act= existed
        extra["gradient_checkpointing"] = True
    return config_cls(
        **extra,
        output_dir=output_dir,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=1,
        max_steps=max_steps,
        learning_rate=args.lr,
        max_length=max_length,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
        remove_unused_columns=False,  # what CPOTrainer sets itself with its default collator
        disable_tqdm=True,
        use_cpu=not _cuda(device),
        use_liger_kernel="liger" in options,
        torch_compile=bool({"compile", "compile-regional"} & options),
        # everything else: TRL's defaults (gradient_checkpointing=True, bf16=True, beta=0.1, cpo_alpha=1.0, sigmoid)
    )


def run_one(
    model_name: str,
    kind: str,
    micro_batch: int,
    max_steps: int,
    warmup: int,
    rows: list[dict[str, str]],
    args,
    device: torch.device,
    tag: str = "bench",
    profile_last: bool = False,
) -> dict:
    """``max_steps`` steps of one trainer on a fresh model; timing, tokens, memory and loss of every step.
    ``profile_last``: the last step runs under torch.profiler and is left out of the timing."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback

    free_memory(device)
    cuda = _cuda(device)
    base, options = parse_variant(kind)
    rec: dict = {
        "tag": tag,
        "model": model_name,
        "trainer": kind,
        "options": sorted(options),
        "micro_batch": micro_batch,
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
        "lengths": args.lengths,
        "cublas_bf16_tflops": getattr(args, "cublas_bf16_tflops", None),
        "max_steps": max_steps,
        "warmup_steps": warmup,
        "ok": False,
        "oom": False,
    }
    if cuda:
        rec["mem_before_gib"] = torch.cuda.memory_allocated() / GIB  # should be ~0: the previous run was freed
        if rec["mem_before_gib"] > 0.25:
            print(f"  warning: {rec['mem_before_gib']:.2f} GiB still allocated from earlier runs", flush=True)
        torch.cuda.reset_peak_memory_stats()
    n_rows = micro_batch * max_steps
    dataset = Dataset.from_list(rows[:n_rows])
    if len(dataset) < n_rows:
        raise ValueError(f"need {n_rows} rows, got {len(dataset)}")
    tokenizer = tokenizer_for(model_name)
    collator = CountingCollator(tokenizer.pad_token_id)
    timer = make_step_timer(device)
    profiler = make_step_profiler(device, max_steps) if profile_last else None
    trainer = model = None
    graphs_before = _dynamo_graphs()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp, variant_scope(options):
        try:
            model = build_model(model_name, device, args.seed, attn_implementation=attention_for(options, cuda))
            rec["flops_model"] = flops_model(model_name, model)
            t_model = time.perf_counter()
            config = make_config(
                tmp,
                micro_batch=micro_batch,
                max_steps=max_steps,
                args=args,
                device=device,
                max_length=MODELS[model_name].get("max_length", args.max_length),
                options=options,
            )
            trainer = trainer_class(kind)(
                model=model,
                args=config,
                train_dataset=dataset,
                processing_class=tokenizer,
                data_collator=collator,
                callbacks=[timer] + ([profiler] if profiler else []),
                peft_config=peft_config_for(model_name),
            )
            for cb in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(cb)
            if base == "fused":
                rec["fused_active"] = bool(getattr(trainer, "use_fused_loss", False))
                plan = getattr(trainer, "activation_plan", None)
                rec["activation_plan"] = dataclasses.asdict(plan) if plan is not None else None
            if "liger" in options:
                rec["liger_kernel_config"] = trainer.args.liger_kernel_config
            t_init = time.perf_counter()
            trainer.train()
            t_train = time.perf_counter()
            rec["build_model_s"] = t_model - t_start
            rec["init_trainer_s"] = t_init - t_model
            rec["train_s"] = t_train - t_init
            history = trainer.state.log_history
            step_logs = [h for h in history if "loss" in h and "step" in h]
            rec["losses"] = [float(h["loss"]) for h in step_logs]
            rec["nll_losses"] = [float(h["nll_loss"]) for h in step_logs if "nll_loss" in h]
            rec["reward_accuracies"] = [float(h["rewards/accuracies"]) for h in step_logs if "rewards/accuracies" in h]
            if options & {"compile", "compile-regional"}:
                rec["compiled"] = type(trainer.model_wrapped).__name__
            rec["ok"] = True
        except Exception as exc:  # OOM is a result (find-max-batch); anything else is reported and fails the run
            rec["oom"] = is_oom(exc)
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            if not rec["oom"]:
                rec["traceback"] = traceback.format_exc()
        finally:
            if trainer is not None:
                try:
                    trainer.accelerator.free_memory()
                except Exception:
                    pass
            del trainer, model
            free_memory(device)
    rec["wall_s"] = time.perf_counter() - t_start
    # Graphs Dynamo compiled in this run (flex_attention and +compile): more than a handful means a recompile per
    # new shape or mask, which max_step_s shows as a slow timed step.
    rec["dynamo_graphs"] = _dynamo_graphs() - graphs_before
    if profiler is not None and profiler.kernels:  # the profiled step is not a timed one
        rec["profiled_step_s"] = timer.times.pop()
        if timer.peaks_gib:
            timer.peaks_gib.pop()
        rec["profile_top"] = profiler.kernels
        rec["step_breakdown_ms"] = bc.step_breakdown(profiler.prof, rec["profiled_step_s"] * 1e3)
    rec["step_times_s"] = timer.times
    rec["batches"] = collator.batches[: len(timer.times)]
    if cuda:
        rec["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        rec["peak_after_step_gib"] = timer.peaks_gib
    summarize(rec)
    return rec


def flops_model(model_name: str, model) -> dict:
    """What ``bench_common.unique_token_flops`` needs of the model (read before LoRA wraps it)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {
        "n_nonembed": bc.non_embedding_params(model),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
        "frozen": MODELS[model_name]["lora"] is not None,
    }


def attention_for(options: frozenset[str], cuda: bool) -> str | None:
    """A packed row on the GPU gets flex_attention's BlockMask, or with ``+sdpa`` the dense ``[N, N]`` mask through
    sdpa (the comparison that says which GPU path wins); padded rows and CPU runs keep transformers' default.
    ``+attn=<name>`` names any registered implementation (e.g. a varlen kernel) and wins."""
    if valued_option(options, "attn"):
        return valued_option(options, "attn")
    if "sdpa" in options:
        return "sdpa"
    return "flex_attention" if cuda and set(LAYOUTS) & options else None


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def variant_scope(options: frozenset[str]):
    """Liger's patch and Dynamo's caches outlive a run: put ``modeling_llama`` back (Liger replaces its RoPE function
    and RMSNorm / MLP classes for every model built after) and reset Dynamo. ``+compile-regional`` sets Accelerate's
    switch for the run (read when the trainer builds its Accelerator)."""
    import contextlib
    import os

    @contextlib.contextmanager
    def scope():
        from transformers.models.llama import modeling_llama

        saved = dict(vars(modeling_llama))
        env = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"
        previous = os.environ.get(env)
        if "compile-regional" in options:
            os.environ[env] = "1"
        try:
            yield
        finally:
            for name, value in saved.items():
                if vars(modeling_llama).get(name) is not value:
                    setattr(modeling_llama, name, value)
            if "compile-regional" in options:
                if previous is None:
                    os.environ.pop(env, None)
                else:
                    os.environ[env] = previous
            if options & {"compile", "compile-regional"}:
                torch._dynamo.reset()

    return scope()


def summarize(rec: dict) -> None:
    """Median step time and tokens/s over the timed steps (those after the warm-up)."""
    times, batches = rec["step_times_s"], rec["batches"]
    timed = list(range(min(rec["warmup_steps"], max(len(times) - 1, 0)), len(times)))
    if times:  # compiled variants compile here: the warm-up's cost, and the slowest timed step (a late recompile)
        rec["warmup_s"] = sum(times[: timed[0] if timed else len(times)])
    if not rec["ok"] or not timed:
        return
    rec["max_step_s"] = max(times[i] for i in timed)
    total_t = sum(times[i] for i in timed)
    rec["timed_steps"] = len(timed)
    rec["step_s"] = statistics.median(times[i] for i in timed)
    for key in ("labelled", "nonpad", "padded"):
        rec[f"{key}_tok_s"] = sum(batches[i][key] for i in timed) / total_t
    for key in ("padded", "padding_free", "prefix_shared"):  # the backbone's work per pair in each layout
        rec[f"{key}_positions_per_pair"] = sum(batches[i][key] for i in timed) / sum(batches[i]["pairs"] for i in timed)
    rec["labelled_per_step"] = statistics.mean(batches[i]["labelled"] for i in timed)
    if rec.get("flops_model"):  # DESIGN's unique-token MFU: each pair once, no recompute, over the dense bf16 peak
        flops = sum(
            bc.unique_token_flops(
                **rec["flops_model"],
                unique=batches[i]["unique"],
                attn_sq=batches[i]["attn_sq"],
                labelled=batches[i]["labelled"],
            )
            for i in timed
        )
        rec["unique_token_tflops"] = flops / total_t / 1e12
        rec["unique_token_mfu"] = flops / total_t / bc.DENSE_BF16_PEAK


# ------------------------------------------------------------------------------------------------ max micro-batch


def find_max_batch(model_name: str, kind: str, args, device: torch.device) -> dict:
    """Largest micro-batch that fits: doubling from --max-batch-start, then bisection to --max-batch-tol.

    Each probe is a fresh model + trainer running --probe-steps steps (the second step is the first with Adam state)
    on worst-case rows (every prompt and completion at its maximum length), so any batch of that size fits; with
    ``--max-batch-rows bench``, on the benchmark's lengths (a packed layout's memory follows its real token count).
    """
    probes: list[dict] = []
    cache: dict[int, bool] = {}
    probe_rows = rows_for(
        model_name,
        args.max_batch_cap * args.probe_steps,
        args.seed + 1,
        worst_case=args.max_batch_rows == "worst",
        profile=args.lengths,
    )

    def fits(mb: int) -> bool:
        if mb not in cache:
            rec = run_one(model_name, kind, mb, args.probe_steps, 0, probe_rows, args, device, tag="probe")
            if not rec["ok"] and not rec["oom"]:
                raise RuntimeError(f"probe {kind} mb={mb} failed: {rec.get('error')}\n{rec.get('traceback', '')}")
            cache[mb] = rec["ok"]
            probes.append({k: rec.get(k) for k in ("micro_batch", "ok", "oom", "peak_gib", "step_times_s", "wall_s")})
            status = "fits" if rec["ok"] else "OOM"
            peak = f", peak {rec['peak_gib']:.1f} GiB" if rec.get("peak_gib") is not None else ""
            print(f"  probe {model_name} {kind} micro-batch {mb}: {status}{peak} ({rec['wall_s']:.0f} s)", flush=True)
        return cache[mb]

    lo, hi = 0, None  # lo fits (0 = nothing yet), hi does not
    mb = max(1, args.max_batch_start)
    while mb <= args.max_batch_cap:
        if fits(mb):
            lo = mb
            mb *= 2
        else:
            hi = mb
            break
    if hi is None:  # reached the cap
        hi_note = f"cap {args.max_batch_cap} reached"
    else:
        while hi - lo > max(1, math.floor(lo * args.max_batch_tol)):
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        hi_note = f"{hi} does not fit"
    return {"max_micro_batch": lo, "first_oom": hi, "note": hi_note, "rows": args.max_batch_rows, "probes": probes}


# ------------------------------------------------------------------------------------------------------ reporting


def compare(runs: list[dict]) -> list[dict]:
    """Every variant vs stock at each (model, micro-batch): speed and memory ratios, loss agreement, identical batches
    (``fused`` first: its rows keep their place and keys); variants of the fused trainer also vs plain fused."""
    out = []
    by_key = {(r["model"], r["micro_batch"], r["trainer"]): r for r in runs}
    order = sorted(by_key.items(), key=lambda item: item[0][2] != "fused")
    for (model, mb, kind), fused in order:
        stock = by_key.get((model, mb, "stock"))
        if kind == "stock" or stock is None or not (stock["ok"] and fused["ok"]):
            continue
        row = {"model": model, "micro_batch": mb, "trainer": kind}
        if stock.get("labelled_tok_s") and fused.get("labelled_tok_s"):
            row["speedup"] = fused["labelled_tok_s"] / stock["labelled_tok_s"]
            row["step_time_ratio"] = fused["step_s"] / stock["step_s"]
        plain = by_key.get((model, mb, "fused"))
        if kind != "fused" and kind.startswith("fused") and plain and plain.get("labelled_tok_s"):
            if fused.get("labelled_tok_s"):
                row["speedup_vs_fused"] = fused["labelled_tok_s"] / plain["labelled_tok_s"]
            if fused.get("peak_gib") and plain.get("peak_gib"):
                row["memory_ratio_vs_fused"] = fused["peak_gib"] / plain["peak_gib"]
        if stock.get("peak_gib") and fused.get("peak_gib"):
            row["memory_ratio"] = fused["peak_gib"] / stock["peak_gib"]
            row["memory_saved_gib"] = stock["peak_gib"] - fused["peak_gib"]
        n = min(len(stock["losses"]), len(fused["losses"]))
        if n:
            diffs = [abs(a - b) for a, b in zip(stock["losses"][:n], fused["losses"][:n], strict=False)]
            row["max_abs_loss_diff"] = max(diffs)
            row["max_rel_loss_diff"] = max(
                d / max(abs(a), 1e-12) for d, a in zip(diffs, stock["losses"][:n], strict=False)
            )
        row["same_batches"] = stock["batches"] == fused["batches"]
        out.append(row)
    return out


def _fmt(x, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def print_table(runs: list[dict], comparisons: list[dict], max_batch: dict) -> None:
    cmp = {(c["model"], c["micro_batch"], c.get("trainer", "fused")): c for c in comparisons}
    header = [
        "trainer",
        "model",
        "micro-batch",
        "step s",
        "labelled tok/s",
        "all tok/s",
        "padded tok/s",
        "peak GiB",
        "vs stock",
    ]
    lines = []
    for r in runs:
        if r["ok"]:
            cells = [
                _fmt(r.get("step_s"), ".3f"),
                _fmt(r.get("labelled_tok_s"), ",.0f"),
                _fmt(r.get("nonpad_tok_s"), ",.0f"),
                _fmt(r.get("padded_tok_s"), ",.0f"),
            ]
        else:
            cells = ["OOM" if r["oom"] else "error", "", "", ""]
        ratio = ""
        c = cmp.get((r["model"], r["micro_batch"], r["trainer"]))
        if c is not None:
            parts = []
            if "speedup" in c:
                parts.append(f"{c['speedup']:.2f}x tok/s")
            if "memory_ratio" in c:
                parts.append(f"{c['memory_ratio']:.2f}x mem")
            if "speedup_vs_fused" in c:
                parts.append(f"{c['speedup_vs_fused']:.2f}x fused's tok/s")
            ratio = ", ".join(parts)
        mb = str(r["micro_batch"]) + (" (max)" if r["tag"] == "max" else "")
        lines.append([r["trainer"], r["model"], mb, *cells, _fmt(r.get("peak_gib"), ".1f"), ratio])
        if r["ok"] and r.get("options"):
            ratio = lines[-1][-1]
            lines[-1][-1] = (ratio + ", " if ratio else "") + f"warm-up {_fmt(r.get('warmup_s'), '.0f')} s"
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=False)]
    fmt_row = lambda row: "  ".join(
        str(x).rjust(w) if i >= 2 else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths, strict=False))
    )
    print()
    print(fmt_row(header))
    print(fmt_row(["-" * w for w in widths]))
    for line in lines:
        print(fmt_row(line))
    print()
    for c in comparisons:
        diff = c.get("max_abs_loss_diff")
        kind = c.get("trainer", "fused")
        print(
            f"{c['model']} micro-batch {c['micro_batch']}: max |loss_{kind} - loss_stock| over steps = "
            f"{_fmt(diff, '.3g')} (rel {_fmt(c.get('max_rel_loss_diff'), '.2e')}); same batches: {c['same_batches']}"
        )
    for model, per_trainer in max_batch.items():
        for kind, res in per_trainer.items():
            run = res.get("run") or {}
            print(
                f"{model} {kind}: largest micro-batch {res['max_micro_batch']} ({res['note']}); there "
                f"{_fmt(run.get('labelled_tok_s'), ',.0f')} labelled tok/s, {_fmt(run.get('peak_gib'), '.1f')} GiB"
            )
        s, f = (per_trainer.get(k, {}).get("run") or {} for k in ("stock", "fused"))
        if s.get("labelled_tok_s") and f.get("labelled_tok_s"):
            print(
                f"{model}: fused/stock labelled tok/s, each at its largest micro-batch = "
                f"{f['labelled_tok_s'] / s['labelled_tok_s']:.2f}x"
            )
        for row in max_batch_vs_fused(model, per_trainer):
            print(
                f"{model} {row['trainer']} / fused: largest micro-batch {row['micro_batch_ratio']:.2f}x, labelled "
                f"tok/s there {_fmt(row.get('speedup'), '.2f')}x"
            )


def max_batch_vs_fused(model: str, per_trainer: dict) -> list[dict]:
    """Each fused variant's largest micro-batch (and its tok/s there) against plain fused's (the padded layout)."""
    base = per_trainer.get("fused")
    if not base or not base["max_micro_batch"]:
        return []
    rows = []
    for kind, res in per_trainer.items():
        if kind == "fused" or parse_variant(kind)[0] != "fused":
            continue
        row = {"model": model, "trainer": kind, "micro_batch_ratio": res["max_micro_batch"] / base["max_micro_batch"]}
        run, base_run = res.get("run") or {}, base.get("run") or {}
        if run.get("labelled_tok_s") and base_run.get("labelled_tok_s"):
            row["speedup"] = run["labelled_tok_s"] / base_run["labelled_tok_s"]
        rows.append(row)
    return rows


def write_plots(results: dict, out: Path) -> list[str]:
    plt = bc.pyplot()
    if plt is None:
        return []
    written = []
    runs = [r for r in results["runs"] if r["ok"]]
    models = list(results["args"]["models"])
    kinds = list(results["args"]["trainer_list"])
    colors = {kind: plt.cm.tab10(i) for i, kind in enumerate(kinds)}

    # loss curves: the --curve-steps runs when present, else the benchmark runs, per micro-batch (none: no plot)
    has_losses = any(r["ok"] for r in results.get("curves", [])) or any(r["tag"] == "bench" for r in runs)
    if has_losses:
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models, strict=False):
            curves = [r for r in results.get("curves", []) if r["model"] == model and r["ok"]]
            source = curves or [r for r in runs if r["model"] == model and r["tag"] == "bench"]
            mbs = sorted({r["micro_batch"] for r in source})
            for j, mb in enumerate(mbs):
                for r in (r for r in source if r["micro_batch"] == mb):
                    steps = list(range(1, len(r["losses"]) + 1))
                    style = (
                        dict(ls="-", marker="o", ms=4) if r["trainer"] == "stock" else dict(ls="--", marker="x", ms=7)
                    )
                    ax.plot(steps, r["losses"], color=plt.cm.tab10(j), label=f"{r['trainer']} mb={mb}", **style)
            ax.set_title(f"{model}: loss per step" + (" (curve runs)" if curves else ""))
            ax.set_xlabel("step")
            ax.set_ylabel("CPO loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "loss_curves.png", dpi=120)
        plt.close(fig)
        written.append("loss_curves.png")

    def bars(metric: str, ylabel: str, fname: str):
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        any_data = False
        for ax, model in zip(axes[0], models, strict=False):
            groups: list[tuple[str, dict]] = []
            bench = [r for r in runs if r["model"] == model and r["tag"] == "bench"]
            for mb in sorted({r["micro_batch"] for r in bench}):
                groups.append((str(mb), {r["trainer"]: r for r in bench if r["micro_batch"] == mb}))
            mx = {r["trainer"]: r for r in runs if r["model"] == model and r["tag"] == "max"}
            if mx:
                label = "max\n" + ", ".join(f"{k[0]}={v['micro_batch']}" for k, v in mx.items())
                groups.append((label, mx))
            width = 0.76 / max(len(kinds), 1)
            for i, (_label, by_kind) in enumerate(groups):
                for k, kind in enumerate(kinds):
                    r = by_kind.get(kind)
                    if r is None or r.get(metric) is None:
                        continue
                    any_data = True
                    x = i + (k - (len(kinds) - 1) / 2) * width
                    ax.bar(x, r[metric], width, color=colors[kind], label=kind if i == 0 else None)
                    ax.text(
                        x,
                        r[metric],
                        f"{r[metric]:,.0f}" if r[metric] >= 100 else f"{r[metric]:.1f}",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
            ax.set_xticks(range(len(groups)), [g[0] for g in groups])
            ax.set_xlabel("micro-batch (pairs)")
            ax.set_ylabel(ylabel)
            ax.set_title(model)
            ax.grid(axis="y", alpha=0.3)
            handles, labels = ax.get_legend_handles_labels()
            if handles:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "not measured (no CUDA)", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        written.append(fname)
        return any_data

    bars("labelled_tok_s", "labelled tokens / s", "throughput.png")
    bars("peak_gib", "peak GPU memory (GiB)", "memory.png")
    return written


# ----------------------------------------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    runnable = [m for m in MODELS if not MODELS[m].get("checkpoint_only")]
    p.add_argument("--model", default="llama3.2-1b", help=f"comma list of: {', '.join(runnable)}")
    p.add_argument("--micro-batches", default="2,4,8", help="comma list of per-device micro-batches (pairs)")
    p.add_argument(
        "--trainers",
        "--variants",
        dest="trainers",
        default="stock,fused",
        help="comma list of stock, fused, each optionally +liger, +compile or +compile-regional (fused+liger+compile); "
        "fused also +padfree, +prefix, +sdpa, +act=<activation_policy>; either trainer +attn=<attn_implementation>",
    )
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per run")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-length", type=int, default=None, help="default: the length profile's (1024; capybara 2048)")
    p.add_argument(
        "--lengths",
        choices=tuple(bc.LENGTH_PROFILES),
        default="synthetic",
        help="length profile of the pairs (bench_common.LENGTH_PROFILES: approximate shapes of real sets)",
    )
    p.add_argument("--curve-steps", type=int, default=0, help="also run N steps per trainer for loss_curves.png")
    p.add_argument("--curve-micro-batch", type=int, default=None, help="micro-batch of the curve runs (first of list)")
    p.add_argument("--find-max-batch", action="store_true", help="search each trainer's largest micro-batch (CUDA)")
    p.add_argument("--max-batch-start", type=int, default=4)
    p.add_argument("--max-batch-cap", type=int, default=256)
    p.add_argument("--max-batch-tol", type=float, default=0.125, help="bisect until (first OOM - fits) <= tol * fits")
    p.add_argument("--probe-steps", type=int, default=2)
    p.add_argument(
        "--max-batch-rows",
        choices=("worst", "bench"),
        default="worst",
        help="probe rows: worst = every prompt and completion at its maximum length (the micro-batch any data fits); "
        "bench = the benchmark's length distribution (what the packed layouts' saving is measured on)",
    )
    p.add_argument(
        "--no-process-warmup",
        dest="process_warmup",
        action="store_false",
        help="skip the untimed 2-step run of each trainer that precedes the measured runs of each model",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more step per run under torch.profiler (not timed): its top kernels go in results.json",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--out", default="outputs/bench_e2e")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="results.json only (fewer files to carry)")
    args = p.parse_args(argv)
    if args.max_length is None:
        args.max_length = bc.LENGTH_PROFILES[args.lengths]["max_length"]
    args.models = [m.strip() for m in args.model.split(",") if m.strip()]
    args.micro_batch_list = [int(x) for x in args.micro_batches.split(",") if x.strip()]
    args.trainer_list = [t.strip() for t in args.trainers.split(",") if t.strip()]
    for m in args.models:
        if m not in runnable:
            p.error(f"unknown model {m!r}; choose from {', '.join(runnable)}")
    for t in args.trainer_list:
        try:
            parse_variant(t)
        except ValueError as err:
            p.error(str(err))
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )
    if not _cuda(device) and any(not MODELS[m].get("toy") for m in args.models):
        print("The Llama-3 shapes need a CUDA GPU; use --model toy on CPU.", file=sys.stderr)
        return 2
    if args.find_max_batch and not _cuda(device):
        print("--find-max-batch needs CUDA (it catches torch.cuda.OutOfMemoryError); skipped on CPU.")
        args.find_max_batch = False

    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()

    if _cuda(device):  # context, allocator and cuBLAS handle up before the first timed run
        x = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
        (x @ x).float().sum().item()
        del x
    args.cublas_bf16_tflops = bc.cublas_bf16_tflops(device)  # the plain GEMM's rate, beside every run's MFU
    if _cuda(device):
        torch.cuda.empty_cache()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict = {
        **bc.run_record(device),
        "args": {k: v for k, v in vars(args).items()},
        "definitions": {
            "step_s": "median over the timed steps of on_step_begin..on_step_end (cuda-synchronized)",
            "labelled_tok_s": "completion tokens of chosen + rejected (labels != -100, EOS included) / timed seconds",
            "nonpad_tok_s": "all non-pad tokens of chosen + rejected (prompt twice) / timed seconds ('all tok/s')",
            "padded_tok_s": "2 x pairs x padded length: the [2B, T] positions the model runs / timed seconds",
            "peak_gib": "torch.cuda.max_memory_allocated over the run (reset before model build) / 2**30",
            "unique_token_mfu": "each pair once (P + C + R positions): backbone K*N_nonembed a position (K = 6 full, "
            "4 frozen base), causal attention 6*L*d*((P+C)^2 + (P+R)^2 - P^2) a pair, head K*V*H a labelled token, "
            "no recompute counted; / timed seconds / 989e12 (dense bf16 peak, H100 SXM and H200)",
            "cublas_bf16_tflops": "8192^3 bf16 matmul in this process (do_bench median): the card's plain-GEMM rate",
            "step_breakdown_ms": "the profiled step's GPU kernels by class (bench_common.kernel_class); idle = the "
            "step's wall time (profiler overhead included) less the kernels' summed time",
        },
        "process_warmup": [],
        "runs": [],
        "curves": [],
        "max_batch": {},
    }
    print(f"device: {results['device']}; versions: {results['versions']}", flush=True)

    steps_total = args.warmup + args.steps
    profiled = int(args.profile)  # one more step, under the profiler, after the timed ones
    for model in args.models:
        n_rows = max(args.micro_batch_list, default=0) * (steps_total + profiled)
        rows = rows_for(model, n_rows, args.seed, profile=args.lengths)
        if args.process_warmup and args.micro_batch_list:  # (--micro-batches "" runs only the curve / max search)
            # One-time costs (CUDA/cuBLAS/SDPA first calls, Triton JIT of the fused kernels, lazy imports) stay out of
            # the first measured run: 2 untimed steps of each trainer at the smallest micro-batch, results discarded.
            mb0 = min(args.micro_batch_list)
            for kind in args.trainer_list:
                rec = run_one(model, kind, mb0, 2, 2, rows, args, device, tag="process-warmup")
                results["process_warmup"].append({k: rec.get(k) for k in ("model", "trainer", "ok", "oom", "wall_s")})
                print(
                    f"{model} {kind} process warm-up: {'ok' if rec['ok'] else rec.get('error')} "
                    f"({rec['wall_s']:.0f} s)",
                    flush=True,
                )
        for mb in args.micro_batch_list:
            for kind in args.trainer_list:
                rec = run_one(
                    model, kind, mb, steps_total + profiled, args.warmup, rows, args, device, profile_last=args.profile
                )
                results["runs"].append(rec)
                status = (
                    f"step {rec['step_s']:.3f} s, {rec['labelled_tok_s']:,.0f} labelled tok/s"
                    if rec.get("step_s") is not None
                    else ("OOM" if rec["oom"] else f"ERROR {rec.get('error')}")
                )
                peak = f", peak {rec['peak_gib']:.1f} GiB" if rec.get("peak_gib") is not None else ""
                print(f"{model} {kind} micro-batch {mb}: {status}{peak} (run {rec['wall_s']:.0f} s)", flush=True)
                if rec.get("traceback"):
                    print(rec["traceback"], file=sys.stderr)
                bc.write_json(out / "results.json", results)  # a call cut off by its limit keeps what finished

        if args.curve_steps > 0:
            cmb = args.curve_micro_batch or (args.micro_batch_list or [2])[0]
            crow = rows_for(model, cmb * args.curve_steps, args.seed + 2, profile=args.lengths)
            for kind in args.trainer_list:
                rec = run_one(model, kind, cmb, args.curve_steps, 0, crow, args, device, tag="curve")
                results["curves"].append(rec)
                print(
                    f"{model} {kind} curve ({args.curve_steps} steps, mb {cmb}): "
                    f"{'ok' if rec['ok'] else rec.get('error')}",
                    flush=True,
                )

        if args.find_max_batch:
            results["max_batch"][model] = {}
            for kind in args.trainer_list:
                res = find_max_batch(model, kind, args, device)
                if res["max_micro_batch"] > 0:
                    mb = res["max_micro_batch"]
                    mrows = rows_for(model, mb * steps_total, args.seed, profile=args.lengths)
                    rec = run_one(model, kind, mb, steps_total, args.warmup, mrows, args, device, tag="max")
                    res["run"] = rec
                    results["runs"].append(rec)
                results["max_batch"][model][kind] = res

    results["comparisons"] = compare([r for r in results["runs"] if r["tag"] == "bench"])
    results["max_batch_comparisons"] = []
    for model, per_trainer in results["max_batch"].items():
        s, f = (per_trainer.get(k, {}).get("run") or {} for k in ("stock", "fused"))
        if s.get("labelled_tok_s") and f.get("labelled_tok_s"):
            results["max_batch_comparisons"].append(
                {
                    "model": model,
                    "stock_micro_batch": s["micro_batch"],
                    "fused_micro_batch": f["micro_batch"],
                    "speedup": f["labelled_tok_s"] / s["labelled_tok_s"],
                    "stock_peak_gib": s.get("peak_gib"),
                    "fused_peak_gib": f.get("peak_gib"),
                }
            )
    results["max_batch_vs_fused"] = [
        row for model, per_trainer in results["max_batch"].items() for row in max_batch_vs_fused(model, per_trainer)
    ]
    results["total_wall_s"] = time.perf_counter() - t0
    print_table(results["runs"], results["comparisons"], results["max_batch"])
    bc.write_json(out / "results.json", results)
    plots = write_plots(results, out) if args.plots else []
    print(
        f"wrote {out / 'results.json'}"
        + (f" and {', '.join(plots)}" if plots else "")
        + f" (total {results['total_wall_s']:.0f} s)"
    )
    failed = [r for r in results["runs"] + results["curves"] if not r["ok"] and not r["oom"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
