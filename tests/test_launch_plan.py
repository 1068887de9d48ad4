"""Launch plans on CPU: recording, rebinding of pointers and the rules that refuse a plan, with a
stand-in kernel whose launcher records what it is given (the CUDA replay is test_launch_plan_gpu)."""

import gc

import pytest
import torch

from padded_moe import launch_plan as LP
from padded_moe.kernels import _launch


class FakeKernel:
    """What `_launch.recording` hands over for a compiled kernel: `run`, `function`, metadata."""

    function = "fn"
    packed_metadata = "meta"

    def __init__(self):
        self.calls = []
        self.run = self._run

    def _run(self, g0, g1, g2, stream, function, metadata, launch_meta, enter, exit_, *args):
        self.calls.append(((g0, g1, g2), stream, args))


@pytest.fixture(autouse=True)
def _stream(monkeypatch):
    monkeypatch.setattr(_launch, "current_stream", lambda device: 1234)


def _launch_event(kernel, grid, args):
    """What `_launch.launch` does for a compiled kernel, minus the launch itself."""
    events = getattr(_launch._RECORD, "events", None)
    if events is not None:
        events.append(("launch", (kernel, grid, tuple(args))))


def make_call(kernel, static, *, extra_op=False, temp=True):
    """A 'call': a temporary and an output allocated, one launch reading the input at an offset,
    the static tensor (through a view), the temporary and the output."""
    def call(x):
        t = torch.empty(8, dtype=torch.int32) if temp else None
        out = torch.empty(x.shape[0], 4)
        if extra_op:
            out.fill_(0)
        args = [x[1:], static[2:], 7, 0.5, None, out] + ([t] if temp else [])
        _launch_event(kernel, (3, 1, 1), args)
        return out
    return call


def test_plan_after_two_agreeing_recordings_rebinds_inputs_and_allocations():
    kernel, plans, static = FakeKernel(), LP.LaunchPlans(), torch.zeros(16)
    call = make_call(kernel, static)
    xs = [torch.randn(5, 4) for _ in range(4)]
    for x in xs[:3]:
        assert plans.get("k") is None
        plans.call("k", 0, (x, None), lambda: call(x))
    plan = plans.get("k")
    assert plan is not None and len(plans) == 1
    kernel.calls.clear()
    out = plan.run((xs[3], None))
    (grid, stream, args), = kernel.calls
    assert grid == (3, 1, 1) and stream == 1234
    assert args[0] == xs[3].data_ptr() + 4 * xs[3].element_size()  # x[1:], rebound to the new input
    assert args[1] == static.data_ptr() + 2 * static.element_size()  # kept: long-lived
    assert args[2:5] == (7, 0.5, None)
    assert args[5] == out.data_ptr() and out.shape == (5, 4)  # the result: a fresh allocation
    assert args[6] not in (0, out.data_ptr())  # the temporary: allocated by the replay too
    # The result is a tensor of its own; the temporary lies in the replay's shared buffer.
    assert plan.offsets == [0, None] and plan.workspace_bytes == LP._ALIGN  # 8 int32 = 32 B, aligned up
    assert plan.result_spec == ((5, 4), (4, 1), torch.float32, torch.device("cpu"))


def test_replay_places_the_temporaries_apart_in_one_buffer():
    """Temporaries of several sizes and dtypes (one passed as a view at an offset) get disjoint,
    aligned places in the replay's shared buffer, at the recorded offsets into each."""
    kernel, plans = FakeKernel(), LP.LaunchPlans()

    def call(x):
        a = torch.empty(3, 5, dtype=torch.float16)
        b = torch.empty(100, dtype=torch.int64)
        out = torch.empty_like(x)
        c = torch.empty(7, dtype=torch.int32)
        _launch_event(kernel, (1, 1, 1), [x, a, b[10:], out, c])
        return out

    for _ in range(3):
        x = torch.randn(4)
        plans.call("k", 0, (x,), lambda: call(x))
    plan = plans.get("k")
    kernel.calls.clear()
    out = plan.run((torch.randn(4),))
    (_, _, (_, pa, pb, po, pc)), = kernel.calls
    assert po == out.data_ptr()
    A = LP._ALIGN
    assert plan.offsets == [0, A, None, A + 4 * A]  # a: 30 B, b: 800 B -> 4 blocks, then c
    assert plan.workspace_bytes == 6 * A
    assert pb == pa + A + 10 * 8 and pc == pa + 5 * A


def test_a_planned_call_inside_a_recorded_one_is_recorded_with_it():
    """A call with a plan of its own, made inside another call's recording (`fused_experts` inside
    `FusedMoE.forward`), runs in full so the outer recording sees its launches: the outer plan
    replays both launches, and the inner key's plan stays as it was."""
    inner_kernel, outer_kernel, plans, static = FakeKernel(), FakeKernel(), LP.LaunchPlans(), torch.zeros(16)
    inner = make_call(inner_kernel, static)

    def inner_planned(x):
        plan = plans.get("inner")
        return plan.run((x, None)) if plan is not None else plans.call("inner", 0, (x, None), lambda: inner(x))

    for _ in range(3):  # the inner key gets its plan first
        inner_planned(torch.randn(5, 4))
    assert plans.get("inner") is not None

    def outer(x):
        y = inner_planned(x)
        _launch_event(outer_kernel, (2, 1, 1), [y, x])
        return y

    for _ in range(3):
        x = torch.randn(5, 4)
        plans.call("outer", 0, (x,), lambda: outer(x))
    plan = plans.get("outer")
    assert plan is not None and len(plans) == 2
    inner_kernel.calls.clear()
    outer_kernel.calls.clear()
    x = torch.randn(5, 4)
    out = plan.run((x,))
    (_, _, inner_args), = inner_kernel.calls
    (_, _, outer_args), = outer_kernel.calls
    assert inner_args[0] == x.data_ptr() + 4 * x.element_size() and inner_args[5] == out.data_ptr()
    assert outer_args == (out.data_ptr(), x.data_ptr())


def test_other_device_work_makes_the_key_unplannable():
    kernel, plans, static = FakeKernel(), LP.LaunchPlans(), torch.zeros(16)
    call = make_call(kernel, static, extra_op=True)
    for _ in range(5):
        x = torch.randn(5, 4)
        plans.call("k", 0, (x,), lambda: call(x))
    assert plans.get("k") is None and len(plans) == 0


def test_unrepeatable_launch_makes_the_key_unplannable():
    plans = LP.LaunchPlans()

    def call(x):
        events = getattr(_launch._RECORD, "events", None)
        if events is not None:
            events.append(("launch", None))
        return torch.empty(2)
    for _ in range(4):
        x = torch.randn(3)
        plans.call("k", 0, (x,), lambda: call(x))
    assert plans.get("k") is None


def test_disagreeing_recordings_give_no_plan_until_two_agree():
    kernel, plans, static = FakeKernel(), LP.LaunchPlans(), torch.zeros(16)
    grids = iter([(1, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1), (3, 1, 1)])

    def call(x):
        out = torch.empty(2)
        _launch_event(kernel, next(grids), [x, out])
        return out
    for n in range(5):
        x = torch.randn(3)
        plans.call("k", 0, (x,), lambda: call(x))
        assert (plans.get("k") is not None) == (n == 4)


def test_plan_dropped_when_a_kept_tensor_is_freed():
    kernel, plans = FakeKernel(), LP.LaunchPlans()
    static = torch.zeros(16)
    call = make_call(kernel, static)
    for _ in range(3):
        x = torch.randn(5, 4)
        plans.call("k", 0, (x,), lambda: call(x))
    assert plans.get("k") is not None
    del static, call
    gc.collect()
    assert plans.get("k") is None


def test_plan_survives_per_call_dtype_views_of_a_kept_tensor():
    """A call that hands its kernel a fresh dtype view of a long-lived tensor each time (a view of
    another element size has no `_base`) keeps its plan while the tensor lives, and loses it when
    the tensor is freed."""
    kernel, plans = FakeKernel(), LP.LaunchPlans()
    static = torch.zeros(16, dtype=torch.uint8)

    def call(x):
        out = torch.empty(x.shape[0], 4)
        _launch_event(kernel, (1, 1, 1), [x, static.view(torch.int32), out])
        return out
    for _ in range(3):
        x = torch.randn(5, 4)
        plans.call("k", 0, (x,), lambda: call(x))
    gc.collect()
    plan = plans.get("k")
    assert plan is not None
    kernel.calls.clear()
    plan.run((torch.randn(5, 4),))
    assert kernel.calls[0][2][1] == static.data_ptr()
    del static, call
    gc.collect()
    assert plans.get("k") is None


def test_result_not_allocated_in_the_call_gives_no_plan():
    kernel, plans = FakeKernel(), LP.LaunchPlans()

    def call(x):
        _launch_event(kernel, (1, 1, 1), [x])
        return x[1:]
    for _ in range(4):
        x = torch.randn(4)
        plans.call("k", 0, (x,), lambda: call(x))
    assert plans.get("k") is None


def test_pointer_holding_objects_are_refused():
    kernel, plans = FakeKernel(), LP.LaunchPlans()

    class Descriptor:
        pass

    def call(x):
        out = torch.empty(1)
        _launch_event(kernel, (1, 1, 1), [Descriptor(), out])
        return out
    for _ in range(4):
        x = torch.randn(4)
        plans.call("k", 0, (x,), lambda: call(x))
    assert plans.get("k") is None


def test_fused_experts_takes_no_plan_on_cpu(cpu_path):
    from padded_moe import experts as X

    x = torch.randn(3, 8)
    w13, w2 = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    tw, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2), dtype=torch.int32)
    assert X._plan_key(x, tw, ids, None, (w13, w2, None, None), X.plan_options("silu", None, None, "auto")) is None


def test_tensor_descriptors_are_rebuilt_over_inputs_and_kept_over_long_lived_tensors():
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel, plans = FakeKernel(), LP.LaunchPlans()
    weight = torch.randn(8, 16)

    def call(x):
        out = torch.empty(4)
        _launch_event(kernel, (1, 1, 1), [TensorDescriptor(x, [4, 16], [16, 1], [4, 16]),
                                          TensorDescriptor(weight, [8, 16], [16, 1], [8, 16]), out])
        return out
    for _ in range(3):
        x = torch.randn(4, 16)
        plans.call("k", 0, (x,), lambda: call(x))
    plan = plans.get("k")
    assert plan is not None
    x = torch.randn(4, 16)
    kernel.calls.clear()
    plan.run((x,))
    (_, _, (xd, wd, _)), = kernel.calls
    assert xd.base.data_ptr() == x.data_ptr() and xd.block_shape == [4, 16]
    assert wd.base.data_ptr() == weight.data_ptr() and not isinstance(wd.base, torch.Tensor)
    del weight, call
    gc.collect()
    assert plans.get("k") is None  # the plan held no reference to the weight


@pytest.mark.parametrize("contiguous", [True, False])
def test_reshape_counts_as_device_work_only_when_it_copies(contiguous):
    """Inside a custom op the dispatch mode sees `aten.reshape` itself: a view when the input
    allows one (plannable), a copy otherwise (no plan)."""
    kernel, plans = FakeKernel(), LP.LaunchPlans()

    def call(x):
        out = torch.empty(4)
        torch.ops.aten.reshape.default(x if contiguous else x.t(), (-1,))
        _launch_event(kernel, (1, 1, 1), [x, out])
        return out
    for _ in range(3):
        x = torch.randn(2, 3)
        plans.call("k", 0, (x,), lambda: call(x))
    assert (plans.get("k") is not None) == contiguous


def test_disabled_plans_record_nothing():
    kernel, plans, static = FakeKernel(), LP.LaunchPlans(enabled=False), torch.zeros(16)
    call = make_call(kernel, static)
    for _ in range(4):
        x = torch.randn(5, 4)
        plans.call("k", 0, (x,), lambda: call(x))
    assert plans.get("k") is None
