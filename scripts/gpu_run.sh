#!/usr/bin/env bash
# One device call: install the carried wheels, then the steps asked for; results under $OUT (only 8 files come back:
# for several steps, point OUT at a scratch folder and tar it into the real $OUT).
#   (on the GPU machine) TRL_FUSED_CPO_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_run.sh [step...]
# The machine's copy of the repository may carry a stale .git: TRL_FUSED_CPO_COMMIT (taken here, before the call)
# names the code measured in every results file, and anything that needs git (the A/B staging) runs here too.
#   steps: tests (GPU-capable tests), tests-cuda (tests/gpu alone, ≈ 40 s: the CUDA-only checks first when device
#          time is short), profile (scripts/profile_fused_op.py: stage timings), wrappers (FSDP2 / ZeRO-3 / LoRA /
#          QLoRA checks), kernel (scripts/benchmark_kernel.py, every peer), kernel-long (fused, fused-lean and floor
#          only, 1.5 s per entry: the steadier ratios), kernel-long-peers (every peer at 1 s an entry, ≈ 4 min),
#          frozen-budgets (the frozen head at 256 / 384 / 512 MiB), trainable-budgets (the trainable head at 1 /
#          1.25 / 1.5 GiB), kernel-b2 (fused and floor only, B = 2, every workload, 1 s an entry, ≈ 40 s: the
#          fixed-cost-bound entries nearest 1.10×), kernel-ab (A/B/A: fused-only long runs of this tree, of each
#          version staged under ab/, then of this tree again), e2e (scripts/benchmark_e2e.py, 1B/3B/8B + 20-step
#          loss curves), e2e-layouts (stock vs fused padded / padding_free / prefix_shared, flex attention, and
#          prefix_shared on sdpa's dense mask),
#          recipe (the 1B recipe through accelerate launch, with its evaluation), qlora-70b (the 70B QLoRA recipe's
#          peak memory at its real widths, 2 and 4 layers, extrapolated to 80), maxbatch / maxbatch-8b (largest
#          micro-batch per trainer, 1B / 8B LoRA), maxbatch-packed (fused padded's largest micro-batch on the
#          benchmark's lengths, then prefix_shared's from 1.5x it), e2e-kernels (Liger's backbone kernels and
#          torch.compile end to end: 1B full and 8B LoRA at 8 pairs, stock / fused / fused+liger / fused+compile /
#          fused+liger+compile, ≈ 5 min), e2e-kernels-regional (the compiled variants with regional compilation, ≈ 2-3 min);
#          attention (scripts/benchmark_attention.py: packed attention alone, every route, ≈ 3 min), probe (the
#          construction probe's cost at Llama-3-8B shape), backbone (unique-token MFU: stock, prefix_shared on flex
#          and on fused_cpo_varlen, activation_policy none / auto; 1B / 16 and 8B LoRA / 8, ≈ 9 min), long-context
#          (the longest pair each trainer trains, 8B LoRA and 1B full, ≈ 18 min: two calls), long-fixed (16k and
#          32k tokens a pair at 8B LoRA);
#          default: tests profile. TESTS_LIMIT_S caps tests / tests-cuda (default 540 s).
# A/B against earlier commits, in one device call. Stage the "before" versions on THIS machine (it has the history),
# then carry "ab" (ignored by git) with the call:
#   bash scripts/gpu_run.sh stage-ab REV [REV...]      # ab/<short rev>/trl_fused_cpo, via git archive; no wheels
#   (device) TRL_FUSED_CPO_COMMIT=<head> bash scripts/gpu_run.sh kernel-ab   # carry .whl and ab
# Each ab/<rev> run imports that tree's package with this tree's scripts (PYTHONPATH=ab/<rev>): the benchmark's
# versions.trl_fused_cpo_path says which copy ran. A run is ≈ 115–130 s; one staged version (three runs) fits a
# 600 s call beside nothing else, two staged versions (four runs, ≈ 500 s) need "tests" in another call.
set -uo pipefail
if [ "${1:-}" = stage-ab ]; then  # on this machine, before the device call
  shift; [ $# -gt 0 ] || { echo "usage: bash scripts/gpu_run.sh stage-ab REV [REV...]" >&2; exit 2; }
  cd "$(dirname "$0")/.." || exit 1
  for rev in "$@"; do
    short=$(git rev-parse --short "$rev") || exit 1
    rm -rf "ab/$short" && mkdir -p "ab/$short" && git archive "$short" trl_fused_cpo | tar -x -C "ab/$short" \
      && echo "staged ab/$short"
  done
  exit 0
fi
bash .whl/gpu-wheels install .whl >/dev/null \
  || { echo "gpu_run: the wheels did not install (carry .whl with ../shared/tools/gpu-wheels copied into it)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
OUT=${OUT:-outputs/gpu}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__)"; }
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests profile)
for what in "${steps[@]}"; do
  case $what in
    tests)  # the whole log goes to $OUT as it is written, so a call cut off by its limit still returns progress
      timeout "${TESTS_LIMIT_S:-540}" python3 -m pytest -q -rfE tests/gpu tests/ops tests/test_loss.py \
        tests/test_edge_cases.py > "$OUT/gpu_tests.txt" 2>&1; tail -25 "$OUT/gpu_tests.txt" ;;
    tests-cuda)
      timeout "${TESTS_LIMIT_S:-540}" python3 -m pytest -q -rfE tests/gpu > "$OUT/gpu_tests_cuda.txt" 2>&1
      tail -8 "$OUT/gpu_tests_cuda.txt" ;;
    wrappers)
      run_check() { local name=$1; shift; timeout 240 "$@" 2>&1 | grep -E "^CHECK|Error|error" | tail -4 | sed "s/^/[$name] /" | tee -a "$OUT/wrappers.txt"; }
      run_check none python3 scripts/check_wrappers.py --check parity
      run_check none-tied python3 scripts/check_wrappers.py --check parity --tie
      run_check fsdp2 accelerate launch --config_file configs/fsdp2.yaml --num_processes 1 --mixed_precision no scripts/check_wrappers.py --check parity
      run_check fsdp2-tied accelerate launch --config_file configs/fsdp2.yaml --num_processes 1 --mixed_precision no scripts/check_wrappers.py --check parity --tie
      run_check zero3 accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 1 --mixed_precision no scripts/check_wrappers.py --check parity
      run_check zero3-tied accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 1 --mixed_precision no scripts/check_wrappers.py --check parity --tie
      run_check lora python3 scripts/check_wrappers.py --check lora
      run_check qlora python3 scripts/check_wrappers.py --check qlora ;;
    profile) python3 scripts/profile_fused_op.py --json "$OUT/profile.json" | tail -60 ;;
    kernel) timeout 330 python3 scripts/benchmark_kernel.py --impls fused,fused-lean,torch,liger,trl-chunked,cce \
              --out "$OUT/kernel" 2>&1 | tail -100 ;;
    frozen-budgets)  # the frozen head's logits budget: 256, 384, 512 MiB, fused and floor only
      for mib in 256 384 512; do
        timeout 100 python3 scripts/benchmark_kernel.py --impls fused --workloads frozen,frozen-masked --no-accuracy \
          --no-plots --warmup 100 --rep 600 --chunk-bytes $((mib << 20)) --out "$OUT/frozen_$mib" 2>&1 \
          | grep -E "^(fused|floor) " | sed "s/^/[$mib MiB] /"
      done ;;
    trainable-budgets)  # the trainable head's logits budget: 1, 1.25, 1.5 GiB, fused and floor only, 1.5 s an entry
      for mib in 1024 1280 1536; do
        timeout 150 python3 scripts/benchmark_kernel.py --impls fused --workloads full,masked --no-accuracy \
          --no-plots --warmup 200 --rep 1500 --chunk-bytes $((mib << 20)) --out "$OUT/trainable_$mib" 2>&1 \
          | grep -E "^(fused|floor) |drift" | sed "s/^/[$mib MiB] /"
      done ;;
    kernel-long) timeout 300 python3 scripts/benchmark_kernel.py --impls fused,fused-lean --no-accuracy --warmup 200 --rep 1500 \
                   --out "$OUT/kernel_long" 2>&1 | grep -E "^(fused|floor) |drift" ;;
    kernel-b2) timeout 120 python3 scripts/benchmark_kernel.py --impls fused --no-accuracy --no-plots --batch-sizes 2 \
                 --warmup 150 --rep 1000 --out "$OUT/kernel_b2" 2>&1 | grep -E "^(fused|floor) |drift" ;;
    kernel-long-peers)  # every peer at 1 s an entry (≈ 4 min): the side-by-side run with steadier ratios
      timeout 420 python3 scripts/benchmark_kernel.py --impls fused,fused-lean,torch,liger,trl-chunked,cce --no-accuracy \
        --warmup 150 --rep 1000 --out "$OUT/kernel_long_peers" 2>&1 | grep -E "^(fused|floor|torch|liger|trl-chunked|cce) |drift" ;;
    kernel-ab)  # A (this tree), B (each staged ab/<rev>), A again; JSON under $OUT/ab_<label>: mind the 8 files a
      # call returns (tar them). AB_BATCH_SIZES=2,16 runs those B only (≈ 55 s a run instead of ≈ 120)
      compgen -G "ab/*/trl_fused_cpo" >/dev/null \
        || { echo "kernel-ab: nothing under ab/: 'bash scripts/gpu_run.sh stage-ab REV' first, carry ab"; continue; }
      ab_run() { echo "[$1] code: $2"; PYTHONPATH=/tmp/site:$2 TRL_FUSED_CPO_COMMIT=$1 timeout 200 python3 \
                   scripts/benchmark_kernel.py --impls fused --no-accuracy --no-plots --warmup 200 --rep 1500 \
                   ${AB_BATCH_SIZES:+--batch-sizes $AB_BATCH_SIZES} --out "$OUT/ab_$1" 2>&1 | grep -E "^(fused|floor) " | sed "s/^/[$1] /"; }
      here=${TRL_FUSED_CPO_COMMIT:-tree}
      ab_run "$here" "$PWD"
      for dir in ab/*/; do [ -d "$dir/trl_fused_cpo" ] && ab_run "$(basename "$dir")" "$PWD/$dir"; done
      ab_run "$here-again" "$PWD" ;;
    e2e) timeout 560 python3 scripts/benchmark_e2e.py --model llama3.2-1b,llama3.2-3b,llama3-8b --micro-batches 2,4,8 \
           --steps 6 --curve-steps 20 --out "$OUT/e2e" 2>&1 | tail -30 ;;
    recipe)  # the Llama-3.2-1B recipe as shipped (prefix_shared on flex) through the launcher, on a random-init
      # checkpoint with the real shapes: 6 steps, then its evaluation on 64 test pairs; RECIPE_ARGS adds launcher flags
      python3 scripts/make_random_checkpoint.py --model llama3.2-1b --out /tmp/llama3.2-1b --test-rows 64 \
        | tee -a "$OUT/recipe_1b.txt"
      timeout 240 accelerate launch --config_file configs/single_gpu.yaml scripts/train_cpo.py \
        --config recipes/llama3_2/1B_full_cpo_single_device.yaml --model_name_or_path /tmp/llama3.2-1b \
        --dataset_name /tmp/llama3.2-1b/data --max_steps 6 --logging_steps 1 --eval_on_start false \
        --save_strategy no --output_dir /tmp/run1b ${RECIPE_ARGS:-} 2>&1 | grep -vE "Map|Generating|it/s]|s/it]" \
        | tail -30 | tee -a "$OUT/recipe_1b.txt" ;;
    qlora-70b)  # the 70B QLoRA recipe's peak memory: its real widths at 2 and 4 decoder layers (worst-case pairs,
      # every prompt and completion at its maximum), both layouts; per-layer cost x 76 more layers = the 80-layer peak
      for layers in 2 4; do
        rm -rf /tmp/l70; python3 scripts/make_random_checkpoint.py --model llama3.1-70b --layers $layers --worst-case \
          --rows 16 --out /tmp/l70 | tee -a "$OUT/qlora_70b.txt"
        for layout in padded prefix_shared; do
          attn=sdpa; [ $layout = prefix_shared ] && attn=flex_attention
          for mb in ${QLORA_MICRO_BATCHES:-2 4}; do
            echo "[70B-width, $layers layers, $layout, micro-batch $mb]" | tee -a "$OUT/qlora_70b.txt"
            timeout 200 accelerate launch --config_file configs/single_gpu.yaml scripts/train_cpo.py \
              --config recipes/llama3_1/70B_qlora_cpo_single_device.yaml --model_name_or_path /tmp/l70 \
              --dataset_name /tmp/l70/preferences.jsonl --max_steps 2 --logging_steps 1 --save_strategy no \
              --per_device_train_batch_size $mb --gradient_accumulation_steps 1 --batch_layout $layout \
              --attn_implementation $attn --output_dir /tmp/run70 2>&1 | grep -E "Peak GPU|Error|error:|'loss'" \
              | tail -4 | tee -a "$OUT/qlora_70b.txt"
          done
        done
      done ;;
    e2e-kernels | e2e-kernels-regional)  # one process per model, cheap variants first; results.json is rewritten after
      # each run, so a model cut off by its limit keeps what finished, and a failing variant is recorded, not fatal
      variants=stock,fused,fused+liger,fused+compile,fused+liger+compile
      [ "$what" = e2e-kernels-regional ] && variants=fused,fused+compile-regional,fused+liger+compile-regional
      IFS=';' read -ra specs <<<"${E2E_KERNEL_SPECS:-llama3.2-1b 140;llama3-8b 170}"  # "model limit_s;..."
      for spec in "${specs[@]}"; do
        read -r model limit <<<"$spec"
        timeout "$limit" python3 scripts/benchmark_e2e.py --model "$model" --micro-batches 8 --steps 4 --warmup 3 \
          --variants "$variants" --no-process-warmup --no-plots --out "$OUT/${what//-/_}_$model" 2>&1 \
          | grep -vE "it/s]|s/it]" | tail -14 | tee -a "$OUT/${what//-/_}.txt"
      done ;;
    e2e-layouts)  # issue 28's side-by-side: stock and the fused trainer padded, padding_free, prefix_shared (flex
      # attention), Llama-3.2-1B full at 8 and 16 pairs, Llama-3-8B LoRA at 8; same batches, one process per model
      # E2E_LAYOUT_SPECS="model micro-batches limit_s;..." narrows it to fit a short device budget; fused+prefix+sdpa
      # is prefix_shared on the dense mask (flex against sdpa); E2E_LAYOUT_VARIANTS overrides the list. --profile:
      # each run's last step under torch.profiler (not timed), its top kernels in results.json (the attention that ran).
      # E2E_LAYOUT_ARGS adds benchmark_e2e.py arguments (e.g. "--curve-steps 20 --curve-micro-batch 8": loss curves)
      IFS=';' read -ra specs <<<"${E2E_LAYOUT_SPECS:-llama3.2-1b 8,16 230;llama3-8b 8 250}"
      for spec in "${specs[@]}"; do
        read -r model batches limit <<<"$spec"
        timeout "$limit" python3 scripts/benchmark_e2e.py --model "$model" --micro-batches "$batches" --steps 4 \
          --warmup 2 --variants "${E2E_LAYOUT_VARIANTS:-stock,fused,fused+padfree,fused+prefix,fused+prefix+sdpa}" --no-process-warmup --no-plots --profile \
          ${E2E_LAYOUT_ARGS:-} --out "$OUT/e2e_layouts_$model" 2>&1 | grep -vE "it/s]|s/it]" | tail -16 | tee -a "$OUT/e2e_layouts.txt"
      done ;;
    # MAXBATCH_VARIANTS (default stock,fused) and MAXBATCH_ARGS (e.g. "--max-batch-rows bench --max-batch-cap 512")
    maxbatch) timeout "${MAXBATCH_LIMIT_S:-560}" python3 scripts/benchmark_e2e.py --model llama3.2-1b --micro-batches "" \
                --find-max-batch --max-batch-start 8 --max-batch-cap 192 --max-batch-tol 0.25 \
                --variants "${MAXBATCH_VARIANTS:-stock,fused}" ${MAXBATCH_ARGS:-} --out "$OUT/e2e_max" 2>&1 \
                | grep -vE "it/s]|s/it]" | tail -24 ;;
    maxbatch-8b) timeout "${MAXBATCH_LIMIT_S:-560}" python3 scripts/benchmark_e2e.py --model llama3-8b --micro-batches "" \
                   --find-max-batch --max-batch-start 24 --max-batch-cap 96 --max-batch-tol 0.25 --steps 2 --warmup 1 \
                   --variants "${MAXBATCH_VARIANTS:-stock,fused}" ${MAXBATCH_ARGS:-} --out "$OUT/e2e_max_8b" 2>&1 \
                   | grep -vE "it/s]|s/it]" | tail -24 ;;
    maxbatch-packed)  # issue 28's largest micro-batch on the benchmark's lengths: fused padded's, searched; then
      # fused+prefix from 1.5x it (the target) upwards. MAXBATCH_MODEL (default llama3.2-1b), MAXBATCH_LIMIT_S per search
      model=${MAXBATCH_MODEL:-llama3.2-1b}; dir="$OUT/maxbatch_packed_$model"
      max_search() {  # variant start cap tol
        timeout "${MAXBATCH_LIMIT_S:-240}" python3 scripts/benchmark_e2e.py --model "$model" --micro-batches "" \
          --find-max-batch --max-batch-rows bench --max-batch-start "$2" --max-batch-cap "$3" --max-batch-tol "$4" \
          --steps 2 --warmup 1 --variants "$1" --no-plots --out "$dir/$1" 2>&1 | grep -E "probe|largest" \
          | tee -a "$OUT/maxbatch_packed.txt"
      }
      max_search fused 32 1024 0.25
      padded=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['max_batch'][sys.argv[2]]['fused']['max_micro_batch'])" \
        "$dir/fused/results.json" "$model" 2>/dev/null)
      if [ -n "$padded" ] && [ "$padded" -gt 0 ]; then
        max_search fused+prefix $(( (3 * padded + 1) / 2 )) $(( 4 * padded )) 0.5
      else echo "maxbatch-packed: no padded maximum for $model" | tee -a "$OUT/maxbatch_packed.txt"; fi ;;
    attention)  # issue 39: packed attention alone, every route checked against the dense reference, then timed
      # (flex static compile, fused_cpo_varlen's flash and cuDNN kernels, sdpa buckets, TRL's padded layout): ≈ 3 min
      timeout 330 python3 scripts/benchmark_attention.py --out "$OUT/attention" 2>&1 | tail -40 ;;
    probe)  # issue 37: the construction probe's cost at Llama-3-8B shape, bf16, per layout and attention: ≈ 2-4 min
      timeout 300 python3 scripts/benchmark_probe.py --shape llama3-8b --device cuda --dtype bfloat16 \
        --implementations sdpa,flex_attention,fused_cpo_varlen --out "$OUT/probe_llama3_8b.json" 2>&1 | tail -20 ;;
    backbone)  # issue 39: unique-token MFU of stock, the code before's packed default (prefix_shared on flex, TRL's
      # blanket checkpointing) and the new options (fused_cpo_varlen, activation_policy none / auto), one process
      # per model, same batches, each step profiled (GEMM / attention / elementwise / head / optimizer / idle).
      # BACKBONE_SPECS="model micro-batches limit_s;...", BACKBONE_VARIANTS overrides the list
      v=stock,fused+prefix,fused+prefix+attn=fused_cpo_varlen,fused+prefix+attn=fused_cpo_varlen+act=none
      v=$v,fused+prefix+attn=fused_cpo_varlen+act=auto,fused+prefix+act=none
      IFS=';' read -ra specs <<<"${BACKBONE_SPECS:-llama3.2-1b 16 270;llama3-8b 8 290}"
      for spec in "${specs[@]}"; do
        read -r model batches limit <<<"$spec"
        timeout "$limit" python3 scripts/benchmark_e2e.py --model "$model" --micro-batches "$batches" --steps 5 \
          --warmup 2 --variants "${BACKBONE_VARIANTS:-$v}" --no-process-warmup --no-plots --profile \
          --out "$OUT/backbone_$model" 2>&1 | grep -vE "it/s]|s/it]" | tail -16 | tee -a "$OUT/backbone.txt"
      done ;;
    long-context)  # issue 40: the longest pair each trainer trains (8B LoRA, then 1B full), then 16k / 32k fixed.
      # Each search is bounded by its --budget-s. LONG_ATTN: the fused trainers' attention (default flex_attention,
      # the recipe's; LONG_ATTN=fused_cpo_varlen compares the varlen form)
      attn=${LONG_ATTN:-flex_attention}
      timeout 560 python3 scripts/benchmark_long_context.py --models llama3.1-8b --steps 1 --start 16384 \
        --tolerance 4096 --granularity 1024 --option tiled_mlp_tokens=8192 --attn "$attn" --budget-s 520 \
        --try-timeout-s 300 --out "$OUT/long_8b" 2>&1 | tail -20
      timeout 560 python3 scripts/benchmark_long_context.py --models llama3.2-1b --steps 2 --start 16384 \
        --tolerance 4096 --granularity 1024 --option tiled_mlp_tokens=8192 --attn "$attn" --budget-s 520 \
        --try-timeout-s 300 --out "$OUT/long_1b" 2>&1 | tail -20 ;;
    long-fixed)  # issue 40: 16k and 32k tokens a pair, each trainer that fits, 8B LoRA
      timeout 560 python3 scripts/benchmark_long_context.py --mode fixed --lengths 16384,32768 --models llama3.1-8b \
        --steps 2 --option tiled_mlp_tokens=8192 --attn "${LONG_ATTN:-flex_attention}" --budget-s 520 \
        --out "$OUT/long_fixed" 2>&1 | tail -20 ;;
    *) echo "unknown step $what" ;;
  esac
done
