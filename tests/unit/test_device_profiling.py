"""benchmarks/device/profiling.py, the GPU proof's profile: real CUDA kernel names and CPU operator names land in
their categories (a kernel of no telling name in that of the operator that launched it), the idle gaps are what no
kernel covers on any stream, a trace's breakdown counts each kernel once and per step, and the trace cut to one step
keeps that step's host spans and the kernels they launched."""

import pytest

from benchmarks.device import profiling
from benchmarks.device.profiling import (ALL_GATHER, ELEMENTWISE, IDLE, LAUNCHES, MATMULS, OTHER, REDUCE_SCATTER,
                                         SPAN, TOTAL, WAIT, breakdown, category, idle_gaps, one_step)

KERNELS = {
    MATMULS: [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel"
        "__5x_cublas",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>"
        "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8::Params)",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
        "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)",
        "triton_tem_fused_mm_0",
    ],
    "attention forward": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, "
        "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 256, 4, false, false, cutlass::bfloat16_t, "
        "Flash_kernel_traits<64, 64, 256, 4, cutlass::bfloat16_t> >, true, false, false>(Flash_fwd_params)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
    ],
    "attention backward": [
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, "
        "4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, "
        "false, true, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)",
        "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, "
        "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> > >"
        "(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<"
        "cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 64, false>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
    ],
    ELEMENTWISE: [
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel("
        "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::"
        "{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, at::native::(anonymous namespace)::"
        "silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::"
        "{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4>)",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
        "BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > "
        ">(at::TensorIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
        "at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, ...)",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
        "_rms_norm_forward_kernel",
    ],
    "copies and dtype casts": [
        "Memcpy DtoD (Device -> Device)",
        "Memcpy HtoD (Pageable -> Device)",
        "Memset (Device)",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
        "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, at::detail::"
        "Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
        "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, ...)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
        "OpaqueType<2u>, unsigned int, 4, 64, 64>(...)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<2>, at::native::(anonymous namespace)::CopyFunctor<c10::BFloat16, float, 2, 1, 1>, "
        "at::native::(anonymous namespace)::Copy<c10::BFloat16, float> >(...)",
        "void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float, c10::BFloat16>(...)",
    ],
    ALL_GATHER: ["ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"],
    REDUCE_SCATTER: ["ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, double, double, double, double, double, bool, bool, float*, float*>(...)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::NormType)1, "
        "float, float>, float*, int>(...)",
    ],
    "loss": [
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, at::native::"
        "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, "
        "float*, float const*, long const*, float const*, bool, long, long, long, long)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<8, float, float, float, at::native::"
        "(anonymous namespace)::LogSoftMaxBackwardEpilogue>(float*, float const*, float const*, long)",
        "liger_cross_entropy_kernel",
    ],
    OTHER: [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
        "true>(...)",
    ],
}

OPERATORS = {
    MATMULS: ["aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "MmBackward0"],
    "attention forward": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                          "aten::_flash_attention_forward", "llmtune::document_sdpa", "FlashAttnVarlenFunc"],
    "attention backward": ["aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                           "ScaledDotProductFlashAttentionForCpuBackward0", "aten::_efficient_attention_backward",
                           "FlashAttnVarlenFuncBackward"],
    ELEMENTWISE: ["aten::mul", "aten::add_", "aten::rsqrt", "aten::silu", "aten::silu_backward", "aten::pow",
                  "aten::fill_"],
    "copies and dtype casts": ["aten::copy_", "aten::_to_copy", "aten::to", "aten::cat", "aten::clone",
                               "aten::_foreach_copy_", "fsdp::chunk_cat", "FSDP::cast_forward_inputs"],
    ALL_GATHER: ["c10d::allgather_", "c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_",
                 "gloo:all_gather", "nccl:_all_gather_base", "FSDP::all_gather"],
    REDUCE_SCATTER: ["c10d::reduce_scatter_", "c10d::_reduce_scatter_base_", "nccl:_reduce_scatter_base"],
    "optimizer": ["aten::_fused_adamw_", "aten::_foreach_add_", "aten::_foreach_norm", "Optimizer.step#AdamW.step"],
    "loss": ["aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax_backward_data",
             "aten::nll_loss_forward", "_ChunkedCrossEntropy", "_ChunkedCrossEntropyBackward"],
    OTHER: ["aten::embedding", "aten::view", "c10d::allreduce_", "ProfilerStep#2"],
}


def test_every_rule_names_a_category_of_the_table():
    assert {name for name, _ in profiling.RULES} <= set(profiling.CATEGORIES)


@pytest.mark.parametrize("names", [KERNELS, OPERATORS], ids=["CUDA kernels", "CPU operators"])
def test_real_names_land_in_their_category(names):
    placed = {name: category([name]) for listed in names.values() for name in listed}
    assert placed == {name: expected for expected, listed in names.items() for name in listed}


def test_a_kernel_of_no_telling_name_takes_the_category_its_operators_name_and_a_telling_one_keeps_its_own():
    elementwise = KERNELS[ELEMENTWISE][1]  # a mean's reduction
    assert category([elementwise, "aten::amax", "_ChunkedCrossEntropy", "ProfilerStep#3"]) == "loss"
    assert category([elementwise, "aten::_foreach_norm"]) == "optimizer", "gradient clipping's norm"
    assert category([elementwise, "aten::mul", "ScaledDotProductFlashAttentionForCpuBackward0"]) == \
        "attention backward"
    assert category([elementwise, "aten::mean", "ProfilerStep#3"]) == ELEMENTWISE
    assert category([KERNELS[MATMULS][0], "aten::mm", "_ChunkedCrossEntropy"]) == MATMULS, "the lm_head's matmul"
    assert category([KERNELS[OTHER][1], "aten::embedding"]) == OTHER
    assert category([]) == OTHER


def test_the_idle_gaps_are_what_no_interval_covers_on_any_stream():
    # two streams: compute 0-10 and 12-20, a collective 8-14 over the gap; then a gap 20-25; nested 25-30 in 25-40
    intervals = [(12, 20), (0, 10), (8, 14), (25, 40), (26, 30), (45, 50), (50, 52)]
    assert idle_gaps(intervals) == [(20, 25), (40, 45)]
    assert profiling.covered(intervals) == 20 + 15 + 7
    assert idle_gaps([(3, 4)]) == [] and idle_gaps([]) == []


def cpu_op(name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": ts, "Record function id": 0, **args}}


def launch(ts, correlation, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}


def kernel(name, ts, dur, correlation, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": stream}}


def step_annotation(number, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "pid": 1, "tid": 1, "ts": ts,
            "dur": dur, "args": {}}


def cuda_step(number: int, at: float) -> list[dict]:
    """One step of 100 µs on the host: a matmul, the loss's reduction (a kernel of no telling name), an all-gather on
    a stream of its own that the matmul hides but for its last 10 µs, then an idle gap before the optimizer."""
    c = 10 * number
    return [step_annotation(number, at, 100),
            cpu_op("aten::mm", at + 1, 5), launch(at + 2, c + 1),
            cpu_op("_ChunkedCrossEntropy", at + 10, 20), cpu_op("aten::amax", at + 11, 5), launch(at + 12, c + 2),
            cpu_op("c10d::_allgather_base_", at + 40, 5), launch(at + 41, c + 3),
            cpu_op("Optimizer.step#AdamW.step", at + 60, 30), launch(at + 61, c + 4),
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "pid": 1, "tid": 1, "ts": at + 2, "id": c + 1},
            kernel(KERNELS[MATMULS][0], at + 10, 30, c + 1),
            kernel(KERNELS[ELEMENTWISE][1], at + 40, 5, c + 2),
            kernel(KERNELS[ALL_GATHER][0], at + 30, 25, c + 3, stream=20),
            kernel("void at::native::vectorized_elementwise_kernel<4, AddFunctor>", at + 70, 10, c + 4)]


CUDA_TRACE = {"schemaVersion": 1, "traceEvents": [
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
    *cuda_step(1, 0), *cuda_step(2, 100), *cuda_step(3, 200)]}


def test_a_cuda_trace_counts_each_kernel_once_per_step_by_category_with_the_wait_the_gaps_and_the_launches():
    rows = breakdown(CUDA_TRACE, 3)
    us = {row: pytest.approx(1000 * rows[row]) for row in rows if row != LAUNCHES}  # per step
    assert (us[MATMULS], us["loss"], us[ALL_GATHER], us["optimizer"], us[TOTAL]) == (30, 5, 25, 10, 70)
    # the all-gather (30-55) runs beside the matmul until 40 and the loss's kernel until 45: 45-55 alone
    assert us[WAIT] == 10
    # kernels cover 10-55 and 70-80 of each 100 µs step: gaps 55-70 in every step, 80-110 between two steps
    assert us[IDLE] == (3 * 15 + 2 * 30) / 3
    assert us[SPAN] == (280 - 10) / 3
    assert rows[LAUNCHES] == 4


def test_a_cpu_trace_counts_each_operators_self_time_placed_by_it_and_its_callers():
    events = [step_annotation(1, 0, 100), cpu_op("aten::linear", 0, 20), cpu_op("aten::t", 1, 2),
              cpu_op("aten::mm", 4, 12), cpu_op("_ChunkedCrossEntropy", 30, 20), cpu_op("aten::amax", 32, 8),
              cpu_op("aten::view", 60, 5)]
    rows = breakdown({"traceEvents": events}, 1)
    us = {row: pytest.approx(1000 * rows[row]) for row in rows if row != LAUNCHES}
    # linear's own 20 - 2 - 12 and t's 2 (under linear) are matmul work, with mm's 12; amax's 8 is the loss's
    assert (us[MATMULS], us["loss"], us[OTHER], us[TOTAL]) == (20, 20, 5, 45)
    assert (us[IDLE], us[SPAN], rows[LAUNCHES]) == (10 + 10, 65, 6)


def test_one_step_keeps_the_middle_steps_host_spans_and_their_kernels_without_the_arrows_and_arguments():
    step = one_step(CUDA_TRACE)
    events = step["traceEvents"]
    assert step["schemaVersion"] == 1
    assert [e["name"] for e in events if e.get("cat") == "user_annotation"] == ["ProfilerStep#2"]
    assert sorted(e["args"]["correlation"] for e in events if e.get("cat") == "kernel") == [21, 22, 23, 24]
    assert all(100 <= e["ts"] < 200 for e in events if e.get("cat") in profiling.HOST)
    assert not [e for e in events if e.get("ph") == "s"], "no flow arrows"
    assert all(e["args"] == {"External id": e["ts"]} for e in events if e.get("cat") == "cpu_op")
    assert [e["name"] for e in events if e.get("ph") == "M"] == ["thread_name"]
    assert breakdown(step, 1)[MATMULS] == breakdown(CUDA_TRACE, 3)[MATMULS]
