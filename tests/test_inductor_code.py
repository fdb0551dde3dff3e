"""Reading inductor's generated wrapper code (`remat.frontends.inductor_code`): its buffers, reuses,
allocating kernels and deletions, on code of the shapes inductor writes, against sums by hand;
a statement of another shape is refused, not guessed."""
from __future__ import annotations

import pytest
import torch

from remat.frontends.inductor_code import UnreadableCode, extent_bytes, follow, step_bytes

CPU = torch.device("cpu")

FORWARD = '''
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        buf0 = empty_strided_cpu((8, 16), (16, 1), torch.float32)
        # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
        extern_kernels.mm(primals_1, primals_2, out=buf0)
        buf1 = empty_strided_cpu((8, 16), (16, 1), torch.bool)
        buf2 = empty_strided_cpu((8, 16), (16, 1), torch.float32)
        cpp_fused_relu_0(buf0, buf1, buf2)
        buf3 = reinterpret_tensor(buf0, (128, ), (1, ), 0); del buf0  # reuse
        # Topologically Sorted Source Nodes: [conv], Original ATen: [aten.convolution]
        buf4 = extern_kernels.convolution(buf2, primals_2, stride=(1, 1))
        assert_size_stride(buf4, (2, 4, 4, 4), (64, 1, 16, 4), 'torch.ops.aten.convolution.default')
        del buf3
        buf5 = empty_strided_cpu((8, 8), (8, 1), torch.float32)
        cpp_fused_sum_1(buf4, buf5)
        return (buf5, buf1, reinterpret_tensor(buf2, (16, 8), (8, 1), 0), primals_2, )
'''

BACKWARD = '''
def call(args):
    gt, relu, primals_2, tangents_1 = args
    args.clear()
    buf0 = empty_strided_cpu((8, 16), (16, 1), torch.float32)
    cpp_fused_threshold_backward_0(tangents_1, gt, relu, buf0)
    del gt
    del tangents_1
    # Topologically Sorted Source Nodes: [cb], Original ATen: [aten.convolution_backward]
    buf1 = torch.ops.aten.convolution_backward.default(buf0, relu, primals_2)
    buf2 = buf1[0]
    assert_size_stride(buf2, (8, 16), (16, 1), 'torch.ops.aten.convolution_backward.default')
    buf3 = buf1[1]
    assert_size_stride(buf3, (16, 16), (16, 1), 'torch.ops.aten.convolution_backward.default')
    del buf1
    del relu
    del buf0
    return (None, buf3, )
'''


def test_extent_of_a_strided_tensor():
    assert extent_bytes([2, 3], [3, 1], 4) == 24
    assert extent_bytes([2, 3], [1, 2], 4) == (1 + 1 + 4) * 4   # (a transposed view spans less)
    assert extent_bytes([4, 0], [1, 1], 4) == 0


def test_the_forward_is_its_buffers_and_what_it_returns():
    run = follow(FORWARD, CPU, lambda names: [(("fixed", n), None) for n in names],
                 input_itemsize=lambda name: 4,
                 scratch=lambda ops, kernel: 100 if ops == ["conv"] and kernel == "convolution" else 0)
    f32, b = 8 * 16 * 4, 8 * 16
    conv = extent_bytes([2, 4, 4, 4], [64, 1, 16, 4], 4)
    # at the convolution: buf0 (reused as buf3), buf1, buf2, its result and its scratch
    assert run.peak_bytes == f32 + b + f32 + conv + 100
    assert run.peak_line.startswith("buf4 = extern_kernels.convolution")
    assert run.inputs == ["primals_1", "primals_2"]
    assert run.returned[3] == ("fixed", "primals_2")
    assert len({k for k in run.returned[:3]}) == 3 and all(k[0] == "code" for k in run.returned[:3])


def test_the_backward_frees_what_it_deletes_and_keeps_what_it_returns():
    peaks = step_bytes(FORWARD, BACKWARD, 1, CPU, lambda names: [("fixed", n) for n in names],
                       lambda name: 32, input_itemsize=lambda graph, name: 4)
    f32, b, result = 8 * 16 * 4, 8 * 16, 8 * 8 * 4
    # saved: the mask (buf1) and the ReLU's output (buf2); the result (buf5) held by the caller
    assert peaks.saved_bytes == b + f32
    # backward: result + mask + relu + tangent + buf0, then the mask and the tangent go before
    # the convolution's two gradients arrive
    start = result + b + f32 + 32 + f32
    at_conv = result + f32 + f32 + f32 + 16 * 16 * 4
    assert peaks.backward_bytes == max(start, at_conv)


def test_results_the_caller_drops_count_only_with_the_backwards_inputs():
    """``keep_outputs=False``: the caller drops the region's results as its backward starts, so
    they count at that instant only, beside the saved values and the tangent, not through the
    backward."""
    peaks = step_bytes(FORWARD, BACKWARD, 1, CPU, lambda names: [("fixed", n) for n in names],
                       lambda name: 32, input_itemsize=lambda graph, name: 4, keep_outputs=False)
    f32, b, result = 8 * 16 * 4, 8 * 16, 8 * 8 * 4
    start = result + b + f32 + 32            # (the results, the saved mask and ReLU output, the tangent)
    at_conv = f32 + f32 + f32 + 16 * 16 * 4  # (the convolution's gradients, without the results)
    assert peaks.backward_bytes == max(start, at_conv) == at_conv
    wide = step_bytes(FORWARD.replace("(8, 8), (8, 1)", "(64, 64), (64, 1)"), BACKWARD,
                      1, CPU, lambda names: [("fixed", n) for n in names], lambda name: 32,
                      input_itemsize=lambda graph, name: 4, keep_outputs=False)
    assert wide.backward_bytes == 64 * 64 * 4 + b + f32 + 32   # (its results set the backward's peak)
    assert wide.backward_line.startswith("(the backward's inputs")


def test_a_kernels_result_inductor_never_asserts_is_sized_by_its_fx_ops_value():
    """Inductor asserts no size of some kernels' results (an integer ``cumsum``): `shape` gives it
    from the fx op the comment names, and the result's bytes count from there."""
    cumsum = FORWARD.replace(
        "        buf5 = empty_strided_cpu((8, 8), (8, 1), torch.float32)\n",
        "        # Topologically Sorted Source Nodes: [pos], Original ATen: [aten.cumsum]\n"
        "        buf5 = torch.ops.aten.cumsum.default(buf4, dim=-1, dtype=torch.int64)\n")
    with pytest.raises(UnreadableCode, match="never asserted"):
        follow(cumsum, CPU, lambda names: [(n, None) for n in names])
    asked = []

    def shape(ops, path, kernel):
        asked.append((ops, path, kernel))
        return [2, 4, 4, 4], [64, 16, 4, 1]
    run = follow(cumsum, CPU, lambda names: [(n, None) for n in names], shape=shape,
                 itemsize=lambda names, size, path, kernel: 8 if kernel == "cumsum" else None,
                 input_itemsize=lambda name: 4)
    assert asked == [(["pos"], (), "cumsum")]
    conv = extent_bytes([2, 4, 4, 4], [64, 1, 16, 4], 4)
    f32, b = 8 * 16 * 4, 8 * 16
    # (at the cumsum: the mask, the ReLU's output, the convolution's result and the int64 sums)
    assert run.peak_bytes == b + f32 + conv + 128 * 8


def test_a_backward_whose_inputs_are_not_what_the_forward_saved_is_refused():
    swapped = BACKWARD.replace("gt, relu, primals_2, tangents_1 = args", "primals_2, gt, relu, tangents_1 = args")
    with pytest.raises(UnreadableCode, match="primals_2"):
        step_bytes(FORWARD, swapped, 1, CPU, lambda names: [("fixed", n) for n in names], lambda name: 32)


def test_a_statement_of_another_shape_is_refused():
    odd = FORWARD.replace("buf5 = empty_strided_cpu((8, 8), (8, 1), torch.float32)", "buf5 = make_buffer(8)")
    with pytest.raises(UnreadableCode, match="make_buffer"):
        follow(odd, CPU, lambda names: [(n, None) for n in names])
    # (an index into what is no kernel's tuple result)
    indexed = FORWARD.replace("buf5 = empty_strided_cpu((8, 8), (8, 1), torch.float32)", "buf5 = primals_1[0]")
    with pytest.raises(UnreadableCode, match=r"primals_1\[0\]"):
        follow(indexed, CPU, lambda names: [(n, None) for n in names])
    unsized = FORWARD.replace("        assert_size_stride(buf4, (2, 4, 4, 4), (64, 1, 16, 4), "
                              "'torch.ops.aten.convolution.default')\n", "")
    with pytest.raises(UnreadableCode, match="buf4"):
        follow(unsized, CPU, lambda names: [(n, None) for n in names])


RANDOM = '''
def call(args):
    primals_1, = args
    args.clear()
    buf0 = empty_strided_cpu((8, 16), (16, 1), torch.float32)
    cpp_fused_gelu_0(primals_1, buf0)
    # Unsorted Source Nodes: [drop], Original ATen: [aten.native_dropout]
    buf1 = torch.ops.higher_order.run_and_save_rng_state(torch.ops.aten.native_dropout.default, buf0, 0.1, True)
    del buf0
    buf2 = buf1[0]
    assert_size_stride(buf2, (5056, ), (1, ), 'torch.ops.run_and_save_rng_state')
    buf3 = buf1[1][0]
    assert_size_stride(buf3, (8, 16), (16, 1), 'torch.ops.run_and_save_rng_state')
    buf4 = buf1[1][1]
    assert_size_stride(buf4, (8, 16), (16, 1), 'torch.ops.run_and_save_rng_state')
    del buf1
    del buf4
    return (buf3, buf2, )
'''


def test_a_kernels_tuple_result_is_allocated_where_it_runs_with_its_input_alive():
    """A random op run through ``run_and_save_rng_state`` (inductor under ``fallback_random``):
    its result, (generator state, (output, mask)), is taken apart after the code drops the op's
    input, but all of it, with the op's scratch, was allocated while the kernel ran with that
    input; the state is bytes, each part's dtype comes by its indices."""
    seen = []

    def itemsize(names, size, path, kernel):
        seen.append((tuple(names), path, kernel))
        return {(1, 0): 4, (1, 1): 1}.get(path)
    run = follow(RANDOM, CPU, lambda names: [(("fixed", n), None) for n in names], itemsize=itemsize,
                 input_itemsize=lambda name: 4,
                 scratch=lambda ops, kernel: 512 if (ops, kernel) == (["drop"], "native_dropout") else 0)
    f32, mask, state = 8 * 16 * 4, 8 * 16, 5056
    # (input, state, output, mask and the op's float draw, at once)
    assert run.peak_bytes == f32 + state + f32 + mask + 512
    assert run.peak_line.startswith("buf1 = torch.ops.higher_order.run_and_save_rng_state")
    assert ((("drop",), (1, 1), "native_dropout")) in seen and all(path != (0,) for _, path, _ in seen)
    assert run.sizes[run.returned[0]] == f32 and run.sizes[run.returned[1]] == state
    # (at the end: what it returns; the input and the mask are gone)
    assert run.trace[-1][0] <= run.peak_bytes and len(run.returned) == 2
