"""The end-to-end benchmark's distance-to-the-limit arithmetic (scripts/bench_common.py): unique-token FLOPs, the
backbone's non-embedding parameters, and the kernel classes of the profiled step, on real kernel names."""

from __future__ import annotations

import pytest
import torch
from conftest import load_script

bc = load_script("bench_common")

# Kernel names from the recorded H100 profiles (docs/results/e2e_layouts_h100/llama3.2-1b.json) and PyTorch's flash.
REAL_KERNELS = {
    "nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0": "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "triton_tem_fused_flex_attention_backward_mul_1": "attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>": (
        "attention"
    ),
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, "
    "3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, "
    "unsigned int, float, 4>)": "elementwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<c10::BFloat16, 2, "
    "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, double*, double*>": (
        "optimizer"
    ),
    "_shifted_exp_kernel": "head",
    "_frozen_dx_kernel": "head",
    "Memcpy HtoD (Pageable -> Device)": "copy",
}


@pytest.mark.parametrize(("name", "cls"), list(REAL_KERNELS.items()), ids=[n[:40] for n in REAL_KERNELS])
def test_kernels_are_classified_by_name(name, cls):
    assert bc.kernel_class(name) == cls


def test_the_scopes_around_a_launch_claim_the_head_and_the_optimizer():
    gemm = "nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN"
    assert bc.kernel_class(gemm, ["aten::mm", "LinearCPOFunction"]) == "head"  # the fused op's own GEMMs
    assert bc.kernel_class(gemm, ["aten::mm", "autograd::engine::evaluate_function: LinearCPOFunctionBackward"]) == (
        "head"
    )
    assert bc.kernel_class("void at::native::vectorized_elementwise_kernel<4>", ["Optimizer.step#AdamW.step"]) == (
        "optimizer"
    )
    assert bc.kernel_class(gemm, ["aten::mm", "aten::linear"]) == "gemm"


def test_unique_token_flops_counts_each_pair_once():
    # one pair P = 3, C = 2, R = 4: 9 unique positions, (5² + 7² - 3²) = 65 visible pairs, 6 labelled tokens
    got = bc.unique_token_flops(
        n_nonembed=1000, layers=2, hidden=8, vocab=50, unique=9, attn_sq=65, labelled=6, frozen=False
    )
    assert got == 6 * 1000 * 9 + 6 * 2 * 8 * 65 + 6 * 50 * 8 * 6
    frozen = bc.unique_token_flops(
        n_nonembed=1000, layers=2, hidden=8, vocab=50, unique=9, attn_sq=65, labelled=6, frozen=True
    )
    assert frozen == 4 * 1000 * 9 + 6 * 2 * 8 * 65 + 4 * 50 * 8 * 6  # attention's backward is not frozen


def test_non_embedding_params_of_llama_3_2_1b():
    with torch.device("meta"):
        model = bc.build_model("llama3.2-1b", torch.device("meta"), seed=0)
    assert bc.non_embedding_params(model) == pytest.approx(0.97e9, rel=0.01)  # DESIGN's N_nonembed


def test_length_profiles_fit_their_max_length():
    for name, profile in bc.LENGTH_PROFILES.items():
        assert profile["prompt_len"][1] + profile["completion_len"][1] + 2 <= profile["max_length"], name
