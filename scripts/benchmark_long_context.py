"""The longest preference pair one GPU trains, per model and trainer: a doubling search, then a bisection.

A try trains ``--steps`` optimizer steps (forward + backward + step; the second is the first with optimizer state)
on one pair of ``L`` tokens, prompt : chosen : rejected = 2 : 1 : 1 (``--ratio``), in a fresh subprocess, so an
out-of-memory leaves nothing behind. The search doubles ``L`` from ``--start`` until a try fails, then bisects to
``--tolerance`` tokens, under a per-try time limit and an overall budget shared by the (model, trainer) pairs; it
records every try (peak memory, step time, labelled tok/s, unique-token MFU, loss) and each pair's
``max_tokens_per_pair``. ``--mode fixed`` measures ``--lengths`` (16k, 32k) for each trainer instead.

Trainers: ``stock`` (TRL's ``CPOTrainer``), ``padded`` and ``prefix_shared`` (``FusedCPOTrainer`` with that
``batch_layout``). ``--option KEY=VALUE`` sets a config field on every trainer whose config has it (e.g.
``tiled_mlp_tokens=8192``, ``gradient_checkpointing=false``; each record's ``applied_options`` says which ran); a
field that ``FusedCPOConfig`` lacks is refused before anything runs (an option this checkout does not have yet). ``--attn`` picks the attention
(``sdpa`` for the padded trainers; ``flex_attention`` for ``prefix_shared`` on CUDA; ``TRAINER=IMPL`` per trainer).

Unique-token MFU (each pair counted once, recompute not counted): ``K·N_nonembed`` a unique position (``K`` = 6 full
fine-tune, 4 LoRA), causal attention ``6·L·d·((P+C)² + (P+R)² − P²)`` a pair, the head ``K·V·H`` a labelled
token, over the step time and ``--peak-tflops`` (989: H100 SXM / H200 dense bf16).

    python scripts/benchmark_long_context.py --models llama3.1-8b,llama3.2-1b --out outputs/long_context
    python scripts/benchmark_long_context.py --mode fixed --lengths 16384,32768 --out outputs/long_context_fixed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import (
    GIB,
    MODELS,
    ROOT,
    build_model,
    device_info,
    pick_device,
    pyplot,
    run_record,
    tokenizer_for,
    unique_token_flops,
    write_json,
)

TRAINERS = ("stock", "padded", "prefix_shared")
DEFAULT_PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM and H200


# ---------------------------------------------------------------------------------------------------- the pair


def split_tokens(total: int, ratio: tuple[int, int, int]) -> tuple[int, int, int]:
    """``(P, C, R)`` token counts of a pair of ``total`` tokens in ``ratio`` (the prompt takes the rounding)."""
    unit = total / sum(ratio)
    chosen, rejected = max(1, round(unit * ratio[1])), max(1, round(unit * ratio[2]))
    return total - chosen - rejected, chosen, rejected


def _words(model_name: str, n: int, offset: int) -> str:
    """``n`` tokens of text for the model's tokenizer (the toy's vocabulary words, or synthetic Llama-3 ids)."""
    if MODELS[model_name].get("toy"):
        from trl_fused_cpo.toy import SPECIAL_TOKENS, toy_vocab

        vocab = toy_vocab()[len(SPECIAL_TOKENS) :]
        return " ".join(vocab[(offset + 7 * i) % len(vocab)] for i in range(n))
    return " ".join(f"t{(offset + 7919 * i) % 128_000}" for i in range(n))


def pair_row(model_name: str, prompt: int, chosen: int, rejected: int) -> dict[str, str]:
    """One row whose tokenized prompt is ``prompt`` tokens with BOS and completions ``chosen`` / ``rejected`` with
    EOS (TRL adds both), so the pair holds ``prompt + chosen + rejected`` unique tokens."""
    return {
        "prompt": _words(model_name, prompt - 1, 0),
        "chosen": " " + _words(model_name, chosen - 1, 1),
        "rejected": " " + _words(model_name, rejected - 1, 2),
    }


# ------------------------------------------------------------------------------------------------------- FLOPs


def nonembedding_params(config) -> int:
    """Decoder-layer parameters of a Llama-architecture config (attention, gated MLP, the two norms) + final norm."""
    d, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size + 2 * d
    return layers * per_layer + d


def pair_flops(config, prompt: int, chosen: int, rejected: int, labelled: int, full: bool) -> float:
    """``bench_common.unique_token_flops`` of one pair: its positions counted once, recompute not counted."""
    return unique_token_flops(
        n_nonembed=nonembedding_params(config),
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        unique=prompt + chosen + rejected,
        attn_sq=(prompt + chosen) ** 2 + (prompt + rejected) ** 2 - prompt**2,
        labelled=labelled,
        frozen=not full,
    )


# ------------------------------------------------------------------------------------------ one try (the child)


def attention_for(trainer: str, overrides: dict[str, str], cuda: bool) -> str:
    if trainer in overrides:
        return overrides[trainer]
    if trainer == "prefix_shared":
        return overrides.get("fused", "flex_attention" if cuda else "sdpa")
    return overrides.get("fused", "sdpa") if trainer == "padded" else "sdpa"


def applied_options(trainer: str, options: dict) -> dict:
    """The options whose field the trainer's config has (stock's ``CPOConfig`` has no fused knobs)."""
    from trl.experimental.cpo import CPOConfig

    from trl_fused_cpo import FusedCPOConfig

    fields = (CPOConfig if trainer == "stock" else FusedCPOConfig).__dataclass_fields__
    return {k: v for k, v in options.items() if k in fields}


def make_config(spec: dict, output_dir: str, cuda: bool):
    """The trainer's config: TRL's defaults, one pair a step, ``--steps`` steps, the options that apply."""
    from trl.experimental.cpo import CPOConfig

    from trl_fused_cpo import FusedCPOConfig

    cls = CPOConfig if spec["trainer"] == "stock" else FusedCPOConfig
    extra = {} if spec["trainer"] == "stock" else {"batch_layout": spec["trainer"]}
    return cls(
        **extra,
        output_dir=output_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_steps=spec["steps"],
        learning_rate=1e-6,
        max_length=spec["max_length"],
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        use_cpu=not cuda,
        bf16=cuda,
        **spec["applied_options"],
    )


def _step_timer(cuda: bool):
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def _build_trainer(spec: dict, tmp: str, device, timer):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback, ProgressCallback
    from trl.experimental.cpo import CPOTrainer

    from trl_fused_cpo import FusedCPOTrainer

    cuda = device.type == "cuda"
    model = build_model(spec["model"], device, 0, attn_implementation=spec["attn_implementation"])
    lora = MODELS[spec["model"]].get("lora")
    trainer = (CPOTrainer if spec["trainer"] == "stock" else FusedCPOTrainer)(
        model=model,
        args=make_config(spec, tmp, cuda),
        train_dataset=Dataset.from_list([pair_row(spec["model"], *spec["split"])] * spec["steps"]),
        processing_class=tokenizer_for(spec["model"]),
        callbacks=[timer],
        peft_config=LoraConfig(task_type="CAUSAL_LM", **lora) if lora else None,
    )
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    return trainer


def run_try(spec: dict) -> dict:
    """Train ``spec["steps"]`` steps on one pair; the record of what happened (OOM is a result, not an error)."""
    import torch
    from bench_common import free_memory, is_oom

    device = pick_device(spec.get("device"))
    cuda = device.type == "cuda"
    rec = {"ok": False, "oom": False, "status": "error", "device_info": device_info(device)}
    timer = _step_timer(cuda)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_long_") as tmp:
        trainer = None
        try:
            trainer = _build_trainer(spec, tmp, device, timer)
            row = trainer.train_dataset[0]
            rec["labelled"] = sum(int(x != -100) for side in ("chosen", "rejected") for x in row[f"{side}_labels"])
            rec["sequence_lengths"] = [len(row["chosen_input_ids"]), len(row["rejected_input_ids"])]
            trainer.train()
            logs = [h for h in trainer.state.log_history if "loss" in h]
            rec.update(ok=True, status="fits", losses=[float(h["loss"]) for h in logs])
        except Exception as exc:  # noqa: BLE001 - the parent reads the status
            rec["oom"] = is_oom(exc)
            rec["status"] = "OOM" if rec["oom"] else "error"
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        finally:
            del trainer
            free_memory(device)
    rec["step_times_s"] = timer.times
    rec["wall_s"] = time.perf_counter() - t0
    if cuda:
        rec["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return rec


def add_rates(rec: dict, spec: dict, peak_tflops: float) -> None:
    """Step time (the last step: the first may compile), labelled tok/s and unique-token MFU of a try that fit."""
    if not rec.get("ok") or not rec.get("step_times_s"):
        return
    config = build_config(spec["model"])
    step_s = rec["step_times_s"][-1]
    flops = pair_flops(config, *spec["split"], rec["labelled"], full=not MODELS[spec["model"]].get("lora"))
    rec["step_s"] = step_s
    rec["labelled_tok_s"] = rec["labelled"] / step_s
    rec["unique_tok_s"] = sum(spec["split"]) / step_s
    rec["mfu"] = flops / step_s / (peak_tflops * 1e12)


def build_config(model_name: str):
    """The model's config without its weights (for the FLOP count)."""
    from transformers import LlamaConfig

    from trl_fused_cpo.toy import toy_config, toy_vocab

    if MODELS[model_name].get("toy"):
        return toy_config(len(toy_vocab()))
    return LlamaConfig(vocab_size=128_256, **MODELS[model_name]["config"])


def context_of(model_name: str) -> int:
    from trl_fused_cpo.context_length import model_context_length

    return model_context_length(build_config(model_name))


# -------------------------------------------------------------------------------------------- the parent's tries


def launch(spec: dict, args, log_dir: Path, timeout_s: float) -> dict:
    """One try in a fresh interpreter (``--in-process``: here, for the CPU tests); its record."""
    if args.in_process:
        return run_try(spec)
    log_dir.mkdir(parents=True, exist_ok=True)
    name = f"{spec['model']}_{spec['trainer']}_{spec['tokens']}"
    result = log_dir / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec), "--child-out", str(result)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with open(log_dir / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"ok": False, "oom": False, "status": "timeout", "wall_s": time.perf_counter() - t0}
    if result.exists():
        return json.loads(result.read_text())
    tail = (log_dir / f"{name}.log").read_text()[-800:]
    crashed = {"ok": False, "oom": "out of memory" in tail.lower(), "status": "crashed", "error": tail}
    return {**crashed, "returncode": proc.returncode, "wall_s": time.perf_counter() - t0}


def try_length(model: str, trainer: str, tokens: int, args, deadline: float) -> dict:
    """The record of one try at ``tokens`` a pair (spec, status, memory, rates)."""
    split = split_tokens(tokens, args.ratio)
    spec = {
        "model": model,
        "trainer": trainer,
        "tokens": tokens,
        "split": list(split),
        "max_length": split[0] + max(split[1], split[2]),  # nothing truncated: TRL cuts completions past it
        "steps": args.steps,
        "options": args.options,
        "applied_options": applied_options(trainer, args.options),
        "attn_implementation": attention_for(trainer, args.attn, args.cuda),
        "device": args.device,
    }
    timeout = max(1.0, min(args.try_timeout_s, deadline - time.perf_counter()))
    rec = launch(spec, args, Path(args.log_dir), timeout)
    add_rates(rec, spec, args.peak_tflops)
    rec = {**spec, **rec}
    peak = f", peak {rec['peak_gib']:.1f} GiB" if rec.get("peak_gib") is not None else ""
    rate = f", {rec['step_s']:.2f} s/step, MFU {rec['mfu']:.1%}" if rec.get("step_s") else ""
    print(
        f"  {model} {trainer} {tokens} tokens: {rec['status']}{peak}{rate} ({rec.get('wall_s', 0):.0f} s)", flush=True
    )
    return rec


def search_longest(fits, *, start: int, cap: int, tolerance: int, granularity: int, out_of_time) -> dict:
    """The largest length ``fits(L)`` accepts: doubling from ``start`` (up to ``cap``), then bisection until the
    bracket is at most ``tolerance`` (lengths multiples of ``granularity``); stops early when ``out_of_time()``.

    ``fits`` returns True, False (does not fit) or None (failed for another reason: the search stops there).
    """
    lo, hi, length, note = 0, None, max(granularity, start), None
    while hi is None and lo < cap and note is None:
        if out_of_time():
            note = "budget spent while doubling"
            break
        verdict = fits(min(length, cap))
        if verdict is None:
            note = "a try failed (not OOM): see its record"
        elif verdict:
            lo, length = min(length, cap), length * 2
        else:
            hi = min(length, cap)
    while note is None and hi is not None and hi - lo > tolerance:
        if out_of_time():
            note = "budget spent while bisecting"
            break
        mid = max(lo + granularity, (lo + hi) // 2 // granularity * granularity)
        if mid >= hi:  # the bracket is one granularity step: nothing left between
            break
        verdict = fits(mid)
        if verdict is None:
            note = "a try failed (not OOM): see its record"
        elif verdict:
            lo = mid
        else:
            hi = mid
    resolved = note is None and (hi is None or hi - lo <= tolerance)
    note = note or ("cap reached" if hi is None else "")
    return {"max_tokens_per_pair": lo, "first_failure": hi, "resolved": resolved, "note": note}


def search_one(model: str, trainer: str, args, share_s: float, deadline: float) -> dict:
    """``search_longest`` for one (model, trainer) within ``share_s`` seconds; every try kept."""
    t0 = time.perf_counter()
    tries: list[dict] = []

    def fits(tokens: int) -> bool | None:
        rec = try_length(model, trainer, tokens, args, deadline)
        tries.append(rec)
        if rec["status"] in ("fits", "OOM", "timeout") or rec.get("oom"):
            return rec["ok"]
        return None

    def out_of_time() -> bool:
        now = time.perf_counter()
        last = tries[-1].get("wall_s", 0) if tries else 0
        return now - t0 + last > share_s or now + last > deadline

    cap = min(args.cap, context_of(model))
    found = search_longest(
        fits, start=args.start, cap=cap, tolerance=args.tolerance, granularity=args.granularity, out_of_time=out_of_time
    )
    best = next((t for t in tries if t["ok"] and t["tokens"] == found["max_tokens_per_pair"]), {})
    summary = {k: best.get(k) for k in ("peak_gib", "step_s", "labelled_tok_s", "mfu", "attn_implementation")}
    head = {"model": model, "trainer": trainer, "layout": _layout(trainer), "cap": cap}
    head["options"] = applied_options(trainer, args.options)  # what this trainer ran with
    return {**head, **found, **summary, "search_s": time.perf_counter() - t0, "tries": tries}


def _layout(trainer: str) -> str:
    return "padded" if trainer in ("stock", "padded") else trainer


def measure_fixed(model: str, trainer: str, args, deadline: float) -> list[dict]:
    """One try at each of ``--lengths`` (skipping those past the model's context or the budget)."""
    records = []
    for tokens in args.lengths:
        if tokens > context_of(model):
            records.append({"model": model, "trainer": trainer, "tokens": tokens, "status": "beyond context"})
        elif time.perf_counter() >= deadline:
            records.append({"model": model, "trainer": trainer, "tokens": tokens, "status": "budget spent"})
        else:
            records.append(try_length(model, trainer, tokens, args, deadline))
    return records


# ------------------------------------------------------------------------------------------------------- output


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    """The search table (one line per model and trainer) and the fixed-length table."""
    gpu = results["device"]
    lines = []
    if results.get("searches"):
        lines += [
            f"Longest pair that trains ({gpu}; prompt : chosen : rejected = {results['ratio']}, {results['steps']} "
            "steps a try)",
            "",
            "| model | trainer | layout | attention | options | max tokens/pair | first failure | peak GiB | "
            "step s | labelled tok/s | MFU | resolved |",
            "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for s in results["searches"]:
            options = ", ".join(f"{k}={v}" for k, v in s["options"].items()) or "-"
            lines.append(
                f"| {s['model']} | {s['trainer']} | {s['layout']} | {s.get('attn_implementation') or '-'} | {options} "
                f"| {s['max_tokens_per_pair']:,} | {_fmt(s['first_failure'], ',')} | {_fmt(s['peak_gib'], '.1f')} | "
                f"{_fmt(s['step_s'], '.2f')} | {_fmt(s['labelled_tok_s'], ',.0f')} | {_fmt(s['mfu'], '.1%')} | "
                f"{'yes' if s['resolved'] else 'no: ' + s['note']} |"
            )
    if results.get("fixed"):
        lines += [
            "",
            f"Fixed lengths ({gpu})",
            "",
            "| model | trainer | options | tokens/pair | status | peak GiB | step s | labelled tok/s | MFU | loss (last "
            "step) |",
            "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in results["fixed"]:
            loss = r.get("losses", [None])[-1] if r.get("losses") else None
            options = ", ".join(f"{k}={v}" for k, v in r.get("applied_options", {}).items()) or "-"
            lines.append(
                f"| {r['model']} | {r['trainer']} | {options} | {r['tokens']:,} | {r['status']} | "
                f"{_fmt(r.get('peak_gib'), '.1f')} "
                f"| {_fmt(r.get('step_s'), '.2f')} | {_fmt(r.get('labelled_tok_s'), ',.0f')} | "
                f"{_fmt(r.get('mfu'), '.1%')} | {_fmt(loss, '.5f')} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> str | None:
    """Peak GiB against tokens a pair, one line per (model, trainer): fits as dots, failures as crosses."""
    tries = [t for s in results.get("searches", []) for t in s["tries"]] + results.get("fixed", [])
    tries = [t for t in tries if t.get("peak_gib") is not None]
    plt = pyplot() if tries else None
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for key in sorted({(t["model"], t["trainer"]) for t in tries}):
        mine = sorted((t for t in tries if (t["model"], t["trainer"]) == key), key=lambda t: t["tokens"])
        ok = [t for t in mine if t["ok"]]
        (line,) = ax.plot([t["tokens"] for t in ok], [t["peak_gib"] for t in ok], "o-", label=" ".join(key))
        bad = [t for t in mine if not t["ok"]]
        ax.plot([t["tokens"] for t in bad], [t["peak_gib"] for t in bad], "x", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per pair")
    ax.set_ylabel("peak allocated GiB")
    ax.set_title(f"One training step a pair ({results['device']}); x: did not fit")
    ax.legend(fontsize=8)
    path = out / "peak_gib_vs_tokens.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------------------------------ command


def _key_values(items: list[str], what: str) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what} {item!r}: expected KEY=VALUE.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a bare string: offload, fused_cpo_varlen
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama3.1-8b,llama3.2-1b", help=f"comma list of: {', '.join(MODELS)}")
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma list of: {', '.join(TRAINERS)}")
    p.add_argument("--mode", choices=("search", "fixed"), default="search")
    p.add_argument("--lengths", default="16384,32768", help="--mode fixed: comma list of tokens a pair")
    p.add_argument("--ratio", default="2:1:1", help="prompt : chosen : rejected")
    p.add_argument("--start", type=int, default=8192, help="first length the doubling tries")
    p.add_argument("--cap", type=int, default=131_072, help="longest length tried (and the model's context)")
    p.add_argument("--tolerance", type=int, default=1024, help="bisect until first failure - fits <= this")
    p.add_argument("--granularity", type=int, default=256, help="lengths tried are multiples of this")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps a try (the 2nd has optimizer state)")
    p.add_argument("--option", action="append", default=[], help="KEY=VALUE config field for every trainer with it")
    p.add_argument("--attn", action="append", default=[], help="IMPL for the fused trainers, or TRAINER=IMPL")
    p.add_argument("--try-timeout-s", type=float, default=240.0)
    p.add_argument("--budget-s", type=float, default=480.0, help="all tries together (default 8 minutes)")
    p.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS)
    p.add_argument("--device", default="auto")
    p.add_argument("--in-process", action="store_true", help="tries in this process (CPU tests; not OOM-safe)")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--out", default="outputs/long_context", help="results.json, results.md, the plot")
    p.add_argument(
        "--log-dir",
        help="each try's log and record (default: a temporary folder; a device call returns only a few files)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models, args.trainers = args.models.split(","), args.trainers.split(",")
    unknown = [m for m in args.models if m not in MODELS] + [t for t in args.trainers if t not in TRAINERS]
    if unknown:
        raise SystemExit(f"unknown model or trainer {unknown}: models {list(MODELS)}, trainers {list(TRAINERS)}.")
    args.granularity = max(1, min(args.granularity, args.tolerance))
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_long_logs_")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.ratio = tuple(int(x) for x in args.ratio.split(":"))
    args.options = _key_values(args.option, "--option")
    args.attn = {k: v for a in args.attn for k, v in ([a.split("=", 1)] if "=" in a else [("fused", a)])}
    return args


def check_options(args) -> None:
    """Refuse, before any try, an option that no fused trainer's config has (this checkout predates it)."""
    from trl_fused_cpo import FusedCPOConfig

    missing = [k for k in args.options if k not in FusedCPOConfig.__dataclass_fields__]
    if missing and any(t != "stock" for t in args.trainers):
        raise SystemExit(
            f"--option {missing}: FusedCPOConfig has no such field in this checkout, so the fused trainers would "
            "run without it and be labelled with it. Drop the option or use a checkout that has it."
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        rec = run_try(json.loads(args.child))
        write_json(args.child_out, rec)
        return 0
    check_options(args)
    # The parent never opens a CUDA context (it would hold GPU memory the tries need): the tries name the device.
    args.cuda = torch.cuda.is_available() if args.device == "auto" else args.device.startswith("cuda")
    out = Path(args.out)
    results = {**run_record(torch.device("cpu")), "mode": args.mode, "ratio": ":".join(map(str, args.ratio))}
    results["steps"] = args.steps
    results.update(options=args.options, attn=args.attn, budget_s=args.budget_s, log_dir=args.log_dir)
    results.update(searches=[], fixed=[])
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    combos = [(m, t) for m in args.models for t in args.trainers]
    for i, (model, trainer) in enumerate(combos):
        if args.mode == "fixed":
            results["fixed"] += measure_fixed(model, trainer, args, deadline)
            continue
        share = (deadline - time.perf_counter()) / (len(combos) - i)
        results["searches"].append(search_one(model, trainer, args, share, deadline))
    results["wall_s"] = time.perf_counter() - t0
    tries = [t for s in results["searches"] for t in s["tries"]] + results["fixed"]
    info = next((t["device_info"] for t in tries if t.get("device_info")), None)
    if info is not None:
        results.update(device=info["name"], device_info=info)
    out.mkdir(parents=True, exist_ok=True)
    if args.plots:
        results["plot"] = plot(results, out)
    write_json(out / "results.json", results)
    table = markdown(results)
    (out / "results.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
