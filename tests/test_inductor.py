"""compiler="inductor": planned steps compiled by Inductor equal torch.compile(backend="inductor"), the karma ops
run where the plan put them, and a plan that moves nothing is exactly Inductor's step.

Inductor's first compile is slow on two cores: the models are small, each model is compiled as few times as
possible, and every test shares one Inductor cache directory (kernels compiled once per session)."""
from __future__ import annotations

import copy
import operator
import re
import warnings

import pytest
import torch
import torch._dynamo

import karma_fx
from karma_fx.config import KarmaConfig
from karma_fx.errors import KarmaError
from karma_fx.plan import Offload, Recompute
from karma_fx.zoo import build, output_to_loss


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """One Inductor cache for the module's compiles (kernels shared between the reference and karma)."""
    from torch._inductor import config

    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    with config.patch(compile_threads=1):  # two cores: a pool of compile workers costs more than it saves
        yield
    mp.undo()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp() -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, 128), torch.nn.GELU()]
    for _ in range(2):
        layers += [torch.nn.Linear(128, 128), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(128, 1))
    return model, (torch.randn(512, 32),), {}


class TwoPass(torch.nn.Module):
    """Residual MLP blocks, each run twice: Inductor's peak-memory reordering changes its backward."""

    def __init__(self, d: int = 32, n: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                torch.nn.Linear(4 * d, d)) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for block in self.blocks:
                x = x + block(x)
        return self.head(x).square().mean()


def two_pass() -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    return TwoPass(), (torch.randn(2, 16, 32),), {}


def megatron() -> tuple[torch.nn.Module, tuple, dict]:
    return build("megatron_gpt", "tiny", batch=8, seq=32, layers=1, hidden=32, vocab=64, dropout=0.0)


def run_steps(model, compiled, args, kwargs, steps=3, schedules=None):
    """Train ``compiled`` (a view of ``model``) and Inductor on a copy side by side, ``steps`` SGD steps;
    assert equal losses and gradients (fp32, relative 1e-5). ``schedules`` records karma's first step."""
    import contextlib

    reference = copy.deepcopy(model)
    plain = torch.compile(reference, backend="inductor", dynamic=False)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(steps):
        with schedules.patch() if schedules is not None and step == 0 else contextlib.nullcontext():
            loss_a = output_to_loss(compiled(*args, **kwargs))
            loss_a.backward()
        loss_b = output_to_loss(plain(*args, **kwargs))
        loss_b.backward()
        assert torch.allclose(loss_a, loss_b, rtol=1e-5, atol=0), (step, loss_a.item(), loss_b.item())
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):
            scale = q.grad.abs().max().clamp_min(1e-30)
            assert ((p.grad - q.grad).abs().max() / scale).item() <= 1e-5, (step, n)
        opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()


# ---- what Inductor ran, in order ------------------------------------------------------------------------------
class Schedules:
    """Records, for each graph Inductor compiles, its final kernel order: per scheduler node (a kernel, fused
    or not, or an extern call), the names of the fx nodes it runs. Installed as Inductor's post-fusion hook, with
    the per-graph code cache off so every graph is scheduled for real."""

    def __init__(self) -> None:
        self.graphs: list[list[set[str]]] = []

    def __call__(self, nodes: list) -> list:
        order = []
        for node in nodes:
            names = {o.name for sub in node.get_nodes() if sub.node is not None for o in sub.node.origins}
            order.append(names)
        self.graphs.append(order)
        return nodes

    @staticmethod
    def available() -> bool:
        from torch._inductor import config

        return hasattr(config, "_post_fusion_custom_pass")  # a private hook: absent from some torch releases

    def patch(self):
        import contextlib

        from torch._inductor import config

        if not self.available():
            return contextlib.nullcontext()
        return config.patch(_post_fusion_custom_pass=self, fx_graph_cache=False)


def assert_karma_ops_in_place(graph: torch.fx.GraphModule, schedule: list[set[str]]) -> int:
    """Every ``karma`` op of ``graph`` runs, in Inductor's ``schedule``, after every op the graph puts before it
    and before every op the graph puts after it: no kernel that runs before the copy or wait holds an op the
    plan put after it, and none that runs after holds one the plan put before it (a fused kernel straddling a
    copy or a wait breaks this). Views are left out: they allocate nothing, and Inductor folds them into the
    strides of their readers. One exception: an op planned before the karma op may run after it inside a
    kernel that also holds an op planned after it, the reader Inductor inlined it into (it computes a pointwise
    value inside each of its readers, and the memory model's ``inlined_reads`` counts the reader reading the
    value's inputs): a GELU's backward inlined into both matmuls of its gradient, on either side of a wait.
    The waits that end a recompute chain run with backward loops (``Recompute.joins``) are not checked: the
    memory model counts that run as one function, from the chain's first op to its last joined op, so where
    in it each of its loops runs changes nothing it counts, and Inductor may fuse them across those waits.
    Returns how many karma ops were checked."""
    from karma_fx.passes.rewrite import JOINED_PIN

    karma = [n.name for n in graph.graph.nodes
             if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "karma"
             and not n.meta.get(JOINED_PIN)]
    order = {n.name: i for i, n in enumerate(graph.graph.nodes)  # views cost nothing: Inductor folds them
             if n.name in karma or not getattr(n.target, "is_view", False)}  # into their readers' strides
    at: dict[str, list[int]] = {}
    for i, names in enumerate(schedule):
        for name in names:
            at.setdefault(name, []).append(i)
    for k in karma:
        assert k in at, f"{k} is not in Inductor's schedule"
        kernel = at[k][-1]
        for name, kernels in at.items():
            if name == k or name not in order or kernel in kernels:
                continue
            if order[name] > order[k]:
                assert all(i > kernel for i in kernels), f"{name} is planned after {k} but runs before it"
                continue
            inlined = all(any(order.get(other, -1) > order[k] for other in schedule[i]) for i in kernels if i > kernel)
            assert inlined, f"{name} is planned before {k} but runs after it"
    return len(karma)


# ---- tests ---------------------------------------------------------------------------------------------------
def test_the_default_compiler_and_karma_compiler(monkeypatch):
    """Unset, every door runs Inductor, the front door with the gradient pipeline included (the suite sets
    $KARMA_COMPILER=eager, see conftest); $KARMA_COMPILER picks for every door."""
    for env in (None, "inductor"):  # unset, then asked for by name: the same doors
        if env is None:
            monkeypatch.delenv("KARMA_COMPILER")
        else:
            monkeypatch.setenv("KARMA_COMPILER", env)
        assert KarmaConfig.make(budget=1.0).compiler == "inductor"
        assert KarmaConfig.from_options({"budget": 1.0}).compiler == "inductor"
        assert karma_fx.compile(torch.nn.Linear(2, 2), budget=1.0)._made_with[0].compiler == "inductor"
        step = karma_fx.compile(torch.nn.Linear(2, 2), budget=1.0, optimizer=torch.optim.SGD)
        assert step._made_with[0].compiler == "inductor"
    monkeypatch.setenv("KARMA_COMPILER", "eager")
    assert KarmaConfig.make(budget=1.0).compiler == "eager"
    step = karma_fx.compile(torch.nn.Linear(2, 2), budget=1.0, optimizer=torch.optim.SGD)
    assert step._made_with[0].compiler == "eager"
    monkeypatch.setenv("KARMA_COMPILER", "tvm")
    with pytest.raises(KarmaError, match=r"\$KARMA_COMPILER must be one of eager, inductor"):
        KarmaConfig.make(budget=1.0)


def test_compiler_is_validated():
    assert KarmaConfig.make(budget=1.0, compiler="eager").compiler == "eager"
    assert KarmaConfig.from_options({"budget": 1.0, "compiler": "inductor"}).compiler == "inductor"
    for bad in ("tvm", "Inductor", 1, ""):
        with pytest.raises(KarmaError, match="compiler must be one of 'eager', 'inductor'"):
            KarmaConfig.make(budget=1.0, compiler=bad)
    with pytest.raises(KarmaError, match="compiler must be"):
        karma_fx.compile(torch.nn.Linear(2, 2), budget=1.0, compiler="aot_eager")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="compiler must be"):
        torch.compile(model, backend="karma", options={"budget": 1.0, "compiler": "xla"})(torch.randn(2, 4))


@pytest.mark.parametrize("build_model", [mlp, two_pass])
def test_nothing_moves_is_exactly_inductor(build_model):
    """Unlimited budget: the same generated code as torch.compile(backend="inductor"), and the same numbers;
    compiled with Inductor's own settings (on ``two_pass`` its peak-memory reordering changes the code)."""
    from torch._inductor.utils import run_and_get_code

    model, args, kwargs = build_model()
    reference = copy.deepcopy(model)
    compiled = karma_fx.compile(model, budget="1TiB", compiler="inductor")

    def step(m):
        loss = output_to_loss(m(*args, **kwargs))
        loss.backward()
        return loss

    loss_a, code_a = run_and_get_code(step, compiled)
    assert not compiled.plan.decisions
    torch._dynamo.reset()
    loss_b, code_b = run_and_get_code(step, torch.compile(reference, backend="inductor", dynamic=False))
    assert torch.equal(loss_a, loss_b)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert len(code_a) == len(code_b) == 2

    def body(code: str) -> str:  # kernels and wrapper; only the compile's serial number differs
        return re.sub(r"^# AOT ID: .*$", "", code, flags=re.M)

    assert [body(c) for c in code_a] == [body(c) for c in code_b]
    assert "karma" not in "".join(code_a)


def test_the_schedule_check_catches_a_kernel_across_a_wait():
    """The checker itself: a kernel running before a wait with an op planned after it fails, and so does an op
    planned before it that runs after it on its own; one inlined into a reader after the wait is in place."""
    def f(x, h):
        a = x * 2
        y = torch.ops.karma.wait.default(h)
        return a + y

    graph = torch.fx.symbolic_trace(f)
    names = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    mul, wait, add = names
    assert assert_karma_ops_in_place(graph, [{mul}, {wait}, {add}]) == 1
    assert assert_karma_ops_in_place(graph, [{wait}, {mul, add}]) == 1  # ``a`` inlined into its reader
    with pytest.raises(AssertionError, match="planned before"):
        assert_karma_ops_in_place(graph, [{wait}, {mul}, {add}])
    with pytest.raises(AssertionError, match="planned after"):
        assert_karma_ops_in_place(graph, [{mul, add}, {wait}])


@pytest.mark.parametrize("build_model, budget, strategy", [(mlp, 0.96, "offload"), (mlp, 0.96, "checkpoint"),
                                                           (megatron, 0.88, "cpsat")])
def test_planned_steps_equal_inductor(build_model, budget, strategy):
    """A budget that forces the plan to move tensors (a fraction between the leanest plan's peak and the
    unplanned one: mlp 0.93-1, megatron 0.77-1): three SGD steps equal plain Inductor's; the copies, waits and
    recomputes run where the plan put them; a steady-state step peaks within the plan and the budget (these
    small steps peak 13-18% below their plans: what the plan counts and Inductor does not allocate is
    left to ``test_planned_peak_is_the_allocator_peak`` and the bench)."""
    model, args, kwargs = build_model()
    # Roofline times: the same plan on every machine (measured ones move the waits from run to run)
    compiled = karma_fx.compile(model, budget=budget, strategy=strategy, compiler="inductor", costs="roofline")
    schedules = Schedules()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(model, compiled, args, kwargs, schedules=schedules)
    plan = compiled.plan
    assert {type(d) for d in plan.decisions} & {Offload, Recompute}, plan.status
    assert not [w for w in caught if "karma_fx" in str(w.message)]  # a planned step compiles without warnings
    assert_measured_within_plan(model, compiled, args, kwargs)
    if any(isinstance(d, Offload) for d in plan.decisions):
        # Copies that land late, as on a GPU's side stream: Inductor must not reuse or overwrite a tensor
        # while it is being copied out (the same graphs, the copy worker made 5 ms slow).
        from karma_fx.runtime import copy_mode, set_copy_delay

        for p in model.parameters():
            p.grad = None
        with copy_mode("threads"):
            set_copy_delay(d2h_s=0.005)
            try:
                run_steps(model, compiled, args, kwargs, steps=2)
            finally:
                set_copy_delay()
    if not Schedules.available():
        return
    fw, bw = compiled.graphs[0]
    assert len(schedules.graphs) == 2
    checked = sum(assert_karma_ops_in_place(g, s) for g, s in zip((fw, bw), schedules.graphs))
    if any(isinstance(d, Offload) for d in plan.decisions):
        assert checked > 0


def test_fused_intermediates_cost_nothing_and_delayed_matmuls_extend_lifetimes():
    """On a hand-made problem: a forward pointwise result read only by a fused pointwise op has 0 bytes; one
    the backward reads, one an extern kernel reads, and one Inductor stores are kept; an ``add(mm, c)`` reads
    the matmul's inputs (Inductor's addmm runs there) and the product has 0 bytes."""
    from karma_fx.fusion import inductor_problem
    from karma_fx.problem import Op, Problem, Storage

    mb = 1 << 20
    ops = (Op("mul", "aten.mul.Tensor", "fwd", ("x",), ("mul",)),
           Op("tanh", "aten.tanh.default", "fwd", ("mul",), ("tanh",)),
           Op("mm", "aten.mm.default", "fwd", ("tanh", "w"), ("mm",)),
           Op("exp", "aten.exp.default", "fwd", ("mm",), ("exp",)),
           Op("mm_1", "aten.mm.default", "bwd", ("exp", "w"), ("mm_1",)),
           Op("add", "aten.add.Tensor", "bwd", ("mm_1", "g"), ("add",)))
    storages = (Storage("x", mb, "input", None, (0,)), Storage("w", mb, "param", None, (2, 4)),
                Storage("g", mb, "tangent", None, (5,), arrives_at=4),
                Storage("mul", mb, "activation", 0, (1,)), Storage("tanh", mb, "activation", 1, (2,)),
                Storage("mm", mb, "activation", 2, (3,)), Storage("exp", mb, "activation", 3, (4,)),
                Storage("mm_1", mb, "temp", 4, (5,)), Storage("add", mb, "gradient", 5, (), is_output=True))
    problem = Problem(ops=ops, storages=storages, num_fwd_ops=4)
    fused = inductor_problem(problem, fusible={"mul", "tanh", "exp", "add"}, inlined={"mul", "exp"})
    sizes = {s.name: s.size_bytes for s in fused.storages}
    assert sizes["mul"] == 0  # inlined into tanh's kernel
    assert sizes["tanh"] == mb  # an extern kernel (mm) reads it
    assert sizes["exp"] == mb  # the backward reads it: saved
    assert sizes["mm_1"] == 0 and fused.ops[5].inputs == ("mm_1", "g", "exp", "w")
    assert fused.storage("exp").users == (4, 5) and fused.storage("w").users == (2, 4, 5)
    assert [s.name for s in fused.saved_activations()] == [s.name for s in problem.saved_activations()]


def test_a_reduction_inductor_generates_is_priced_at_the_steps_elementwise_rate():
    """Measured op times are eager kernels; Inductor runs a reduction as loops it generates. A reduction slower
    per byte than the step's pointwise ops (ATen's CPU ``var_mean``: 25x) is priced at their median rate; one
    at or under it keeps its time, and a reduction Inductor does not compile (not fusible here) keeps its own."""
    from karma_fx.costs import Costs
    from karma_fx.fusion import generated_reduction_costs
    from karma_fx.problem import Op, Problem, Storage

    mb = 1 << 20
    ops = (Op("mul", "aten.mul.Tensor", "fwd", ("x",), ("mul",), bytes_accessed=2 * mb),
           Op("add", "aten.add.Tensor", "fwd", ("mul",), ("add",), bytes_accessed=2 * mb),
           Op("sub", "aten.sub.Tensor", "fwd", ("add",), ("sub",), bytes_accessed=2 * mb),
           Op("var_mean", "aten.var_mean.correction", "fwd", ("sub",), ("var_mean",), bytes_accessed=mb),
           Op("sum", "aten.sum.dim_IntList", "fwd", ("sub",), ("sum",), bytes_accessed=mb),
           Op("amax", "aten.amax.default", "fwd", ("sub",), ("amax",), bytes_accessed=mb))
    storages = (Storage("x", mb, "input", None, (0,)), Storage("mul", mb, "temp", 0, (1,)),
                Storage("add", mb, "temp", 1, (2,)), Storage("sub", mb, "temp", 2, (3, 4, 5)),
                *(Storage(n, 64, "gradient", k, (), is_output=True)
                  for k, n in ((3, "var_mean"), (4, "sum"), (5, "amax"))))
    problem = Problem(ops=ops, storages=storages, num_fwd_ops=6)
    # the launch: the 10th percentile of the six times, 40 µs; the pointwise ops move 2 MiB in 70 µs of work
    costs = Costs(op_time_us=(110.0, 110.0, 110.0, 2000.0, 40.0, 900.0), d2h_bytes_per_us=1e4,
                  h2d_bytes_per_us=1e4, copy_latency_us=0.0, device="cpu")
    priced = generated_reduction_costs(problem, costs, {"mul", "add", "sub", "var_mean", "sum"})
    assert priced.op_time_us[:3] == costs.op_time_us[:3]
    assert priced.op_time_us[3] == pytest.approx(40.0 + 35.0)  # its launch, then 1 MiB at that rate
    assert priced.op_time_us[4] == 40.0  # its launch is all of it: already under the rate
    assert priced.op_time_us[5] == 900.0  # not computed in Inductor's loops here: its own kernel runs
    assert generated_reduction_costs(problem, costs, {"var_mean"}) == costs  # no pointwise op to take a rate from


def test_an_embedding_gradient_is_one_buffer_and_its_addmm_ends_the_loop_kernel():
    """A tied embedding's gradient: Inductor writes the zero fill into the scatter's own output (one buffer,
    not a fill and a copy), the scatter always stores its result, and the ``add(mm, scatter)`` it rewrites to
    ``addmm`` is an extern kernel, so the loop kernel before it (the layer norm's backward, the scatter) does
    not hold its buffers until the add. Counted otherwise, a decoder's step was predicted 3-5% over its peak."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from karma_fx.fusion import inductor_problem
    from karma_fx.passes.fusible import fusible_ops, inlined_ops
    from karma_fx.problem import Op, Problem, Storage

    def grad(idx, mask, values):
        zeros = torch.zeros(16, 8)
        return torch.ops.aten._unsafe_masked_index_put_accumulate(zeros, mask, [idx], values)

    graph = make_fx(grad)(torch.tensor([1, 3]), torch.tensor([[True], [True]]), torch.randn(2, 8)).graph
    scatter = next(n.name for n in graph.nodes if "index_put" in str(n.target))
    fill = next(n.name for n in graph.nodes if n.op == "call_function" and n.name != scatter)
    assert scatter in fusible_ops(graph) and scatter not in inlined_ops(graph) and fill in inlined_ops(graph)

    mb = 1 << 20
    ops = (Op("mm", "aten.mm.default", "bwd", ("a", "h"), ("mm",)),
           Op("mul", "aten.mul.Tensor", "bwd", ("g",), ("mul",)),
           Op("sum", "aten.sum.dim_IntList", "bwd", ("mul",), ("sum",)),
           Op("full", "aten.full.default", "bwd", (), ("full",)),
           Op("put", "aten._unsafe_masked_index_put_accumulate.default", "bwd", ("full", "idx", "mul"), ("put",)),
           Op("add", "aten.add.Tensor", "bwd", ("mm", "put"), ("add",)))
    storages = (Storage("a", mb, "input", None, (0,)), Storage("h", mb, "input", None, (0,)),
                Storage("g", mb, "input", None, (1,)), Storage("idx", 1024, "input", None, (4,)),
                Storage("mm", 2 * mb, "temp", 0, (5,)), Storage("mul", mb, "temp", 1, (2, 4)),
                Storage("sum", 1024, "gradient", 2, (), is_output=True), Storage("full", 2 * mb, "temp", 3, (4,)),
                Storage("put", 2 * mb, "temp", 4, (5,)), Storage("add", 2 * mb, "gradient", 5, (), is_output=True))
    problem = Problem(ops=ops, storages=storages, num_fwd_ops=0)
    held = inductor_problem(problem, fusible={"mul", "sum", "full", "put", "add"}, inlined={"full"})
    sizes = {s.name: s.size_bytes for s in held.storages}
    assert sizes["full"] == 0 and sizes["put"] == 2 * mb and sizes["mm"] == 0  # one buffer; addmm's product
    assert held.storage("mul").users == (2, 4)  # the loop kernel ends at the scatter, not at the addmm


def test_a_result_an_extern_kernel_reads_is_a_buffer_its_other_readers_read():
    """A ReLU over four inputs that a convolution reads is realised (extern kernels read buffers), so the mask
    taken of it, read by three kernels, reads two buffers (the ReLU and the gradient) and is inlined into
    each, as Inductor does. Counted as inlined, the ReLU lent the mask its four reads, the mask looked too
    costly to inline, and the model freed the ReLU where the mask was made, not where its readers ran."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from karma_fx.passes.fusible import inlined_ops

    def step(a, b, c, d, w, g):
        r = torch.relu((a - b) * c + d)
        y = torch.nn.functional.conv2d(r, w)
        mask = torch.where(r <= 0, 0.0, g)
        return y, mask.sum(), mask * 3, mask - 1

    inputs = [torch.randn(2, 4, 8, 8) for _ in range(4)] + [torch.randn(4, 4, 1, 1), torch.randn(2, 4, 8, 8)]
    graph = make_fx(step)(*inputs).graph
    inlined = inlined_ops(graph)
    relu = next(n.name for n in graph.nodes if n.target == torch.ops.aten.relu.default)
    where = next(n.name for n in graph.nodes if n.target == torch.ops.aten.where.self)
    assert relu not in inlined and where in inlined


def assert_measured_within_plan(model, compiled, args, kwargs, below=None, slack=0.001, loss=output_to_loss):
    """A steady-state step of ``compiled`` (its output made a loss by ``loss``) peaks on the allocator
    (torch.profiler memory events) at no more than the plan's peak (``slack``: a fraction of it, for the few
    bytes no model sees: the loss's scalar, a kernel's row buffer) nor the budget, and, given ``below``, no
    further than that fraction under it."""
    from karma_fx.measure_run import measure_step_peak

    measured = measure_step_peak(model, compiled, args, kwargs, loss).peak_bytes
    session = compiled._session
    planned = compiled.predicted_peak_bytes
    assert measured <= planned * (1 + slack), (measured, planned)
    assert measured <= session.budget_bytes, (measured, session.budget_bytes)
    if below is not None:
        assert measured >= planned * (1 - below), (measured, planned)


def steady(compiled, model, args, kwargs, steps: int = 2) -> None:
    """Train ``compiled`` (a view of ``model``) ``steps`` steps, gradients cleared after each: past the steps
    that trace and measure, so that the next is a steady one."""
    for _ in range(steps):
        output_to_loss(compiled(*args, **kwargs)).backward()
        for p in model.parameters():
            p.grad = None


class PoolCNN(torch.nn.Module):
    """Two convolutions, a 1x1 convolution and an average pooling (a DenseNet transition), a linear head."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 1), nn.AvgPool2d(2))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def test_a_pooling_input_read_for_its_shape_lives_until_the_backward_returns():
    """The average pooling's backward reads its input for its sizes only, so no Inductor kernel reads the
    saved 1x1 convolution output and the backward graph never frees it. Counted as freed at the pooling's
    backward, a plan that keeps it peaked 13.9% above itself (1 MiB); now at its plan. The budget is just
    under the step as written (Inductor's, channels-last), which peaks below the partition the plans count."""
    torch.manual_seed(0)
    model, x = PoolCNN(), torch.randn(16, 3, 32, 32)
    compiled = karma_fx.compile(model, budget=0.99, strategy="cpsat", compiler="inductor", costs="roofline")
    steady(compiled, model, (x,), {})
    pool_input = "convolution_2"
    # a plan (moves, or kernels split: which is faster depends on a split's measured time), keeping the input
    assert compiled.plan.decisions or compiled.plan.splits
    assert not any(pool_input == getattr(d, "tensor", "") or pool_input in getattr(d, "tensors", ())
                   for d in compiled.plan.decisions)
    problem = compiled.regions[-1].prepared.problem
    assert problem.storage(pool_input).users[-1] == len(problem.ops) - 1
    assert_measured_within_plan(model, compiled, (x,), {}, below=0.02)


def test_late_copies_leave_an_attention_step_exact_and_at_its_plan():
    """A 1-layer GPT with dropout (math attention) whose saved tensors are all offloaded: a step with copies
    5 ms late on the copy worker gives the loss and gradients of one with synchronous copies (relative 1e-5:
    the embedding's backward may sum in another order), and peaks at the plan. Inductor used to write an offloaded ``clone`` of a transposed view in its
    input's order and copy the returned host tensor into a buffer of the traced layout, in the forward, with
    no wait for the copy: gradients 110% off with late copies (and 2 MiB per tensor above the plan on the
    4-layer bench GPT). The rewrite now gives each ``karma`` node its traced inputs (``eager_input_vals``),
    which is what makes Inductor hold the offload's input to the traced strides. With the late copies the step
    peaks at its plan too."""
    from karma_fx.runtime import copy_mode, set_copy_delay

    model, args, kwargs = build("megatron_gpt", "tiny", batch=2, seq=128, layers=1, hidden=64, heads=4,
                                vocab=128, dropout=0.1)
    compiled = karma_fx.compile(model, budget=0.99, strategy="offload", compiler="inductor")

    def step(mode, delay):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(0)  # the same dropout masks in both steps
        with copy_mode(mode):
            set_copy_delay(d2h_s=delay)
            try:
                loss = output_to_loss(compiled(*args, **kwargs))
                loss.backward()
            finally:
                set_copy_delay()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    step("sync", 0.0)
    loss_a, grads_a = step("sync", 0.0)
    loss_b, grads_b = step("threads", 0.005)
    assert sum(isinstance(d, Offload) for d in compiled.plan.decisions) > 10, compiled.plan.status
    assert torch.allclose(loss_a, loss_b, rtol=1e-6, atol=0)
    for (name, _), a, b in zip(model.named_parameters(), grads_a, grads_b):  # summation order may differ
        assert ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() <= 1e-5, name
    assert_measured_within_plan(model, compiled, args, kwargs, below=0.05)
    with copy_mode("threads"):  # late copies cost a stall, not memory: compute waits where the plan frees
        set_copy_delay(d2h_s=0.005)
        try:
            assert_measured_within_plan(model, compiled, args, kwargs)
        finally:
            set_copy_delay()


def test_what_a_run_of_loop_ops_writes_lives_until_the_run_ends():
    """A softmax and dropout between two matmuls (one fused kernel under Inductor, which allocates every
    buffer it writes before it runs): each stored result of the run is read by its last op too, so the
    replay holds them all there; a run never spans a matmul or the forward/backward boundary, and a result
    nothing reads is not held."""
    from karma_fx.costs import Costs
    from karma_fx.fusion import inductor_problem, loop_runs
    from karma_fx.problem import Op, Problem, Storage
    from karma_fx.simulate import simulate

    mb = 1 << 20
    ops = (Op("bmm", "aten.bmm.default", "fwd", ("q",), ("bmm",)),
           Op("exp", "aten.exp.default", "fwd", ("bmm",), ("exp",)),
           Op("sum", "aten.sum.dim_IntList", "fwd", ("exp",), ("sum",)),
           Op("div", "aten.div.Tensor", "fwd", ("exp", "sum"), ("div",)),
           Op("rand", "prims.inductor_random.default", "fwd", (), ("rand",)),
           Op("gt", "aten.gt.Scalar", "fwd", ("rand",), ("gt",)),
           Op("mul", "aten.mul.Tensor", "fwd", ("div", "gt"), ("mul",)),
           Op("bmm_1", "aten.bmm.default", "fwd", ("mul",), ("bmm_1",)),
           Op("neg", "aten.neg.default", "bwd", ("bmm_1", "div"), ("neg",)))
    storages = (Storage("q", mb, "input", None, (0,)), Storage("bmm", 4 * mb, "activation", 0, (1,)),
                Storage("exp", 4 * mb, "activation", 1, (2, 3)), Storage("sum", 1024, "activation", 2, (3,)),
                Storage("div", 4 * mb, "activation", 3, (6, 8)), Storage("rand", 4 * mb, "activation", 4, (5,)),
                Storage("gt", mb, "activation", 5, (6,)), Storage("mul", 4 * mb, "activation", 6, (7,)),
                Storage("bmm_1", mb, "activation", 7, (8,)),
                Storage("neg", mb, "gradient", 8, (), is_output=True))
    problem = Problem(ops=ops, storages=storages, num_fwd_ops=8)
    fusible = {"exp", "sum", "div", "gt", "mul", "neg"}
    assert loop_runs(problem, fusible) == ((1, 2, 3, 4, 5, 6),)  # not past bmm_1, not into the backward
    held = inductor_problem(problem, fusible, inlined=())
    # exp is written over the matmul's output, which dies there (in place): that buffer is held instead
    assert held.ops[6].inputs == ("div", "gt", "exp", "sum", "rand", "bmm")
    assert held.storage("exp").size_bytes == 0 and held.storage("bmm").users == (1, 2, 3, 6)
    assert held.storage("rand").users == (5, 6) and held.storage("div").users == (6, 8)
    costs = Costs(op_time_us=(1.0,) * len(ops), d2h_bytes_per_us=1.0, h2d_bytes_per_us=1.0, copy_latency_us=0.0,
                  device="test")
    before, after = simulate(problem, (), costs), simulate(held, (), costs)
    assert after.peak_op == "mul"
    # at the run's last op: q (input), exp (in the matmul's buffer), sum, div, rand, gt and mul
    assert after.peak_bytes == mb + 4 * mb + 1024 + 4 * mb + 4 * mb + mb + 4 * mb
    assert before.peak_bytes < after.peak_bytes


def test_a_run_of_loop_ops_spans_an_op_inductor_drops_or_moves():
    """On a CPU Inductor writes the loops between two extern kernels as one function. An empty buffer nothing
    reads (dropped as dead code) and a matmul its post-grad pass turns into an ``addmm`` at its add (no kernel
    where the graph has it) do not end that function: the exponential's buffer, read by the sigmoid after
    both, is held until the run's last loop, and the dead buffer costs nothing."""
    from karma_fx.fusion import inductor_problem
    from karma_fx.problem import Op, Problem, Storage

    mb = 1 << 20
    ops = (Op("exp", "aten.exp.default", "fwd", ("q",), ("e",)),
           Op("empty", "aten.new_empty_strided.default", "fwd", ("e",), ("z",)),
           Op("mm", "aten.mm.default", "fwd", ("e", "w"), ("m",)),
           Op("sig", "aten.sigmoid.default", "fwd", ("e",), ("s",)),
           Op("neg", "aten.neg.default", "fwd", ("q",), ("n",)),
           Op("add", "aten.add.Tensor", "fwd", ("m", "n"), ("a",)),
           Op("mm_1", "aten.mm.default", "fwd", ("a", "s"), ("o",)))
    storages = (Storage("q", mb, "input", None, (0, 4)), Storage("w", mb, "param", None, (2,)),
                Storage("e", mb, "activation", 0, (1, 2, 3)), Storage("z", mb, "activation", 1, ()),
                Storage("m", mb, "activation", 2, (5,)), Storage("s", mb, "activation", 3, (6,)),
                Storage("n", mb, "activation", 4, (5,)), Storage("a", mb, "activation", 5, (6,)),
                Storage("o", mb, "activation", 6, (), is_output=True))
    problem = Problem(ops=ops, storages=storages, num_fwd_ops=7)
    held = inductor_problem(problem, {"exp", "sig", "neg", "add"}, inlined=())
    assert held.storage("z").size_bytes == 0 and held.storage("m").size_bytes == 0
    assert held.ops[4].inputs == ("q", "e", "s")  # the run exp, sig, neg holds what exp and sig write


def test_a_planned_graph_never_fuses_across_an_extern_kernel():
    """``PlanOrder`` refuses a fusion whose members lie on both sides of an extern kernel in the scheduler's
    order, and leaves every other choice to the handler it wraps."""
    from types import SimpleNamespace

    from torch._inductor.scheduler import ExternKernelSchedulerNode

    from karma_fx.inductor import PlanOrder

    def node(order, extern=False):
        n = object.__new__(ExternKernelSchedulerNode) if extern else SimpleNamespace()
        n.min_order = n.max_order = order
        return n

    class Scheduler:
        nodes = [node(0), node(1), node(2, extern=True), node(3), node(4)]

    calls = []
    inner = SimpleNamespace(can_fuse=lambda *a: calls.append(a) or True, score_fusion="inner's")
    order, scheduler = PlanOrder(inner), Scheduler()
    a, b, _, c, d = scheduler.nodes
    assert order.can_fuse(scheduler, a, b, 1) and order.can_fuse(scheduler, d, c, 1)
    assert not order.can_fuse(scheduler, a, c, 1) and not order.can_fuse(scheduler, d, b, 1)
    fused = SimpleNamespace(min_order=0, max_order=1)  # a kernel already made of a and b
    assert order.can_fuse(scheduler, fused, b, 1) and not order.can_fuse(scheduler, fused, d, 1)
    assert len(calls) == 3 and order.score_fusion == "inner's"


def test_planned_peak_is_the_allocator_peak():
    """Budget 1.0 on a small GPT: the plan moves nothing, and the step is ``torch.compile``'s own, peaking on
    the allocator exactly where plain ``torch.compile(backend="inductor")`` does, at the plan's peak, within
    the budget. Inductor's min-cut partition of this step peaks 52 KB higher than the partition the plan
    counts (it saves both embeddings to rebuild their sum in the backward): the step as written counts that
    (``min_cut_excess``), where before the step ran the default partition instead (lower, but slower, and not
    the step the user had). Inductor's buffer reuse, unguarded with its peak-memory pass off, held a 0.5 MiB
    buffer across a 2 MiB matmul: 2.4% over the plan and over the budget before a step that moves nothing kept
    that pass on, as Inductor does. A planned step's peak is checked in ``test_planned_steps_equal_inductor``."""
    from karma_fx.measure_run import measure_step_peak

    config = dict(batch=8, seq=128, layers=2, hidden=128, vocab=512, dropout=0.0)
    peaks = []
    for door in ("karma", "torch"):
        torch._dynamo.reset()
        model, args, kwargs = build("megatron_gpt", "tiny", **config)
        compiled = (karma_fx.compile(model, budget=1.0, compiler="inductor") if door == "karma"
                    else torch.compile(model, backend="inductor", dynamic=False))
        for _ in range(2):
            output_to_loss(compiled(*args, **kwargs)).backward()
            for p in model.parameters():  # gradients kept across steps would be memory the budget must hold
                p.grad = None
        if door == "karma":
            assert not compiled.plan.decisions and compiled.plan.status == "KEEP"
            assert_measured_within_plan(model, compiled, args, kwargs, below=0.001)
        peaks.append(measure_step_peak(model, compiled, args, kwargs, output_to_loss).peak_bytes)
    assert peaks[0] == peaks[1]


class SavesItsInput(torch.nn.Module):
    """Two regions (a graph break): the second's min-cut partition saves its input ``h`` and recomputes
    ``relu(h)`` in the backward, where PyTorch's default partition, which the plans count, saves ``relu(h)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.w1 = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w0
        torch._dynamo.graph_break()
        a = torch.relu(h)
        return ((a * a) @ self.w1).sum()


def test_an_input_inductors_own_partition_saves_is_held_by_the_step_as_written():
    """The step as written is Inductor's min-cut partition: an input of a region it saves for the backward (free
    to it: the region holds its inputs) lives on through the step, and the footprint says so, though the
    partition planned does not save it (before, the input was counted as freed after the forward)."""
    from karma_fx.measure_run import measure_step_peak

    torch.manual_seed(0)
    model, x = SavesItsInput(), torch.randn(8, 256, 64)
    compiled = karma_fx.compile(model, budget=1.0, compiler="inductor")
    for _ in range(3):
        compiled(x).backward()
        for p in model.parameters():
            p.grad = None
    second = compiled.regions[1]
    assert second.last is second.keep and second.keep.inductors_own
    h_bytes = 8 * 256 * 64 * 4
    assert (h_bytes, True) in second.keep.fp.inputs
    assert second.keep.fp.internal_held_bytes == h_bytes  # one tensor besides h; the default partition saves two
    measured = measure_step_peak(model, compiled, (x,), {}, lambda loss: loss).peak_bytes
    assert measured <= compiled.predicted_peak_bytes


@pytest.mark.parametrize("config, below", [
    (dict(batch=8, seq=128, layers=2, hidden=128, vocab=512, dropout=0.0), 0.01),
    (dict(batch=4, seq=128, layers=2, hidden=64, heads=4, vocab=256, dropout=0.1), 0.12)], ids=["no-dropout", "dropout"])
def test_a_planned_step_peaks_at_its_plan(config, below):
    """Small GPTs checkpointed at 0.9 of their peak: the step peaks at the plan's peak, or under it by no more
    than ``below``. Without dropout, Inductor's buffer reuse held a freed buffer of each recomputed block in the
    backward until a later one of the same size took it: 33% above the plan (within the budget here; past it
    on the bench's 4-layer d=512 GPT), so a planned graph is compiled without buffer reuse
    (``PLANNED_CONFIG``). With dropout (math attention), the softmax and dropout of a recomputed block ran as
    fused kernels that write all their S×S buffers at once, one of them fused with the softmax backward:
    35% above the plan, until ``outputs_held_through_runs`` counted them and ``PlanOrder`` kept kernels from
    fusing across a matmul. Up to 8% under: the model holds the backward's temporaries a function of loops
    reads until the function returns (``fusion.inputs_held_through_runs``), and a recomputation placed inside
    one ends it sooner (with dropout, a 128 KiB matmul output counted through a recomputed attention; 5.1-7.7%
    under, depending on the plan the step's timings chose). Roofline times make the plan the same on every
    machine and under any load (two test workers sharing two cores once made measured timings choose the plan
    roofline times choose): without dropout the step peaks at its plan to 0.004%; with dropout 11.5% under
    it, the model over-counting where a recomputation ends a function of loops early (not mended)."""
    model, args, kwargs = build("megatron_gpt", "tiny", **config)
    compiled = karma_fx.compile(model, budget=0.9, strategy="checkpoint", compiler="inductor", costs="roofline")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steady(compiled, model, args, kwargs)
    assert any(isinstance(d, Recompute) for d in compiled.plan.decisions), compiled.plan.status
    assert not [w for w in caught if "karma_fx" in str(w.message)]
    assert_measured_within_plan(model, compiled, args, kwargs, below=below)


def test_a_forward_function_holds_what_it_reads_until_it_returns():
    """A small GPT planned at 0.7 of its peak (S=256, 8 heads: the attention scores are 8 MiB): Inductor's softmax
    kernel reads the scores and allocates the exponentials and the probabilities before it runs, so the scores
    live until the kernel returns. Freed at their last read in the graph, the planned step peaked 14.7% above its
    plan and past its budget (``simulate._forward_function_ends``)."""
    model, args, kwargs = build("megatron_gpt", "tiny", batch=2, seq=256, layers=2, hidden=128, heads=8, vocab=256)
    compiled = karma_fx.compile(model, budget=0.7, compiler="inductor", costs="roofline", loss_chunk=0)
    steady(compiled, model, args, kwargs)
    assert any(isinstance(d, Offload) for d in compiled.plan.decisions), compiled.plan.status
    assert_measured_within_plan(model, compiled, args, kwargs, below=0.03)


def test_a_fused_chain_costs_its_kernel_not_the_sum_of_its_ops():
    """On a hand-made problem: a forward chain ``mul -> add -> sum`` whose two pointwise results Inductor
    inlines is one kernel: it reads ``x`` and ``y`` once and writes the reduction only, with one launch, so
    the chain costs ``overhead + external bytes / bandwidth`` (not three launches and every intermediate
    written and read back), shared among its ops in proportion to their own times; the matmul, alone in its
    kernel, keeps its time. Measured op times are scaled by the same bytes."""
    import math

    from karma_fx.costs import Costs, estimate_costs
    from karma_fx.device import DeviceSpec
    from karma_fx.fusion import inductor_model, kernel_costs, kernel_groups
    from karma_fx.problem import Op, Problem, Storage

    mb = 1 << 20
    spec = DeviceSpec(name="toy", memory_bytes=1 << 30, peak_flops={"float32": 100e12}, hbm_bytes_per_s=1e12,
                      d2h_bytes_per_s=10e9, h2d_bytes_per_s=10e9, kernel_overhead_us=3.0, efficiency=0.5)
    ops = (Op("mul", "aten.mul.Tensor", "fwd", ("x",), ("mul",), flops=mb // 4, bytes_accessed=2 * mb),
           Op("add", "aten.add.Tensor", "fwd", ("mul", "y"), ("add",), flops=mb // 4, bytes_accessed=3 * mb),
           Op("sum", "aten.sum.dim_IntList", "fwd", ("add",), ("sum",), flops=mb // 4, bytes_accessed=mb + 4096),
           Op("mm", "aten.mm.default", "fwd", ("sum", "w"), ("mm",), flops=1 << 30, bytes_accessed=3 * 4096),
           Op("mm_1", "aten.mm.default", "bwd", ("g", "w"), ("mm_1",), flops=1 << 30,
              bytes_accessed=3 * 4096))
    storages = (Storage("x", mb, "input", None, (0,)), Storage("y", mb, "input", None, (1,)),
                Storage("w", 4096, "param", None, (3, 4)), Storage("g", 4096, "tangent", None, (4,), arrives_at=4),
                Storage("mul", mb, "activation", 0, (1,)), Storage("add", mb, "activation", 1, (2,)),
                Storage("sum", 4096, "activation", 2, (3,)), Storage("mm", 4096, "activation", 3, (4,)),
                Storage("mm_1", 4096, "gradient", 4, (), is_output=True))
    problem = Problem(ops=ops, storages=storages, num_fwd_ops=4)
    unfused = estimate_costs(problem, spec)
    fused_problem, costs = inductor_model(problem, unfused, fusible={"mul", "add", "sum"},
                                          inlined={"mul", "add"}, device=spec)
    assert [s.size_bytes for s in fused_problem.storages[4:6]] == [0, 0]
    assert kernel_groups(fused_problem, {"mul", "add"}) == ((0, 1, 2), (3,), (4,))
    kernel = 3.0 + (2 * mb + 4096) / 1e6  # x and y read once, the 4 KiB reduction written; one launch
    chain = costs.op_time_us[:3]
    assert math.fsum(chain) == pytest.approx(kernel, rel=1e-12)
    assert math.fsum(chain) < math.fsum(unfused.op_time_us[:3]) / 2  # was 3 launches and 6 MiB moved
    for t, u in zip(chain, unfused.op_time_us[:3]):  # each op's share: its part of the unfused chain
        assert t / kernel == pytest.approx(u / math.fsum(unfused.op_time_us[:3]), rel=1e-12)
    assert costs.op_time_us[3:] == unfused.op_time_us[3:]

    # measured: each member's work (its time less a launch, the 10th percentile of the step's op times) scales
    # by the group's bytes over the bytes the ops move one by one, but the kernel's work is never less than its
    # slowest member's work; plus one launch
    moved, external = 6 * mb + 4096, 2 * mb + 4096
    for times, launch, work in (
            ((40.0, 40.0, 40.0, 5.0, 100.0), 5.0, 105.0 * external / moved),  # an even chain: its traffic
            ((25.0, 35.0, 15.0, 100.0, 100.0), 15.0, 20.0)):  # the add's own work outlasts the scaled traffic
        measured = Costs(op_time_us=times, d2h_bytes_per_us=1e4, h2d_bytes_per_us=1e4, copy_latency_us=1.0,
                         device="measured")
        costs = kernel_costs(fused_problem, measured, {"mul", "add"}, measured=True)
        assert math.fsum(costs.op_time_us[:3]) == pytest.approx(launch + work, rel=1e-12)
        assert costs.op_time_us[3:] == times[3:]
        # the whole model first prices the sum at the pointwise ops' rate (``generated_reduction_costs``):
        # the add moves 3 MiB in its work, 35 µs in the even chain, and the sum's 1 MiB then takes a third
        # of that, so the chain is the add's work and a launch; the other chain's sum is under that rate
        _, costs = inductor_model(problem, measured, {"mul", "add", "sum"}, {"mul", "add"}, measured=True)
        assert math.fsum(costs.op_time_us[:3]) == pytest.approx(launch + (35.0 if times[0] == 40.0 else work),
                                                                rel=1e-12)
        assert costs.op_time_us[3:] == times[3:]


def test_plan_for_inductor_is_the_plan_compile_makes(capsys):
    """karma_fx.plan(compiler="inductor") (and the CLI's --compiler inductor) plans the joint graph the Inductor
    compile plans (Inductor's decompositions and joint passes): at the budget the compiled region planned for,
    the same decisions, peaks and times."""
    model, args, kwargs = build("megatron_gpt", "tiny", batch=4, seq=32, layers=1, hidden=32, vocab=64)
    compiled = karma_fx.compile(model, budget=0.8, costs="roofline", compiler="inductor")
    output_to_loss(compiled(*args, **kwargs)).backward()
    made = compiled.plan
    assert made.decisions  # 0.8 of the step leaves the region something to do
    planned = karma_fx.plan(model, args, kwargs, budget=made.budget_bytes, costs="roofline", compiler="inductor")
    assert planned.decisions == made.decisions
    assert (planned.peak_bytes, planned.unplanned_peak_bytes, planned.step_time_us) == \
        (made.peak_bytes, made.unplanned_peak_bytes, made.step_time_us)
    eager = karma_fx.plan(model, args, kwargs, budget=made.budget_bytes, costs="roofline")
    assert eager.unplanned_peak_bytes != made.unplanned_peak_bytes  # the two compilers' steps do differ here

    from karma_fx.budget import format_bytes
    from karma_fx.cli import main

    printed = {}
    for compiler in ("eager", "inductor"):
        assert main(["plan", "megatron_gpt", "--size", "tiny", "--batch", "4", "--seq", "32", "--layers", "1",
                     "--compiler", compiler, "--budget", "1.0", "--quiet"]) == 0
        printed[compiler] = capsys.readouterr().out
    tiny = build("megatron_gpt", "tiny", batch=4, seq=32, layers=1)
    unplanned = karma_fx.plan(*tiny, budget=1.0, device="h100", compiler="inductor").unplanned_peak_bytes
    assert f"unplanned peak {format_bytes(unplanned)}" in printed["inductor"]
    assert printed["inductor"] != printed["eager"]


def test_plan_prices_a_cnns_step_as_written_as_compile_does():
    """A CNN's convolutions run channels-last in Inductor's step as written, their scratch measured so: the
    session priced it, ``karma_fx.prepare`` did not, and counted the step 20.8% above compile's (871,648 B
    against 721,720 for the zoo's tiny CNN), so a fraction budget named two different steps. One function prices
    it for both doors (``pricing.as_written``). What is left apart: the compiled graph writes a BatchNorm's
    running statistics back with ``copy_`` where the traced one returns them (472 B here)."""
    model, args, kwargs = build("cnn", "tiny")
    compiled = karma_fx.compile(model, budget=1.0, costs="roofline", compiler="inductor")
    steady(compiled, model, args, kwargs)
    prepared = karma_fx.prepare(model, args, kwargs, costs="roofline", compiler="inductor")
    assert prepared.keep_all_excess.channels_last and prepared.keep_all_excess.scratch
    assert prepared.unplanned_peak_bytes == pytest.approx(compiled.unplanned_peak_bytes, rel=0.002)


def test_a_pointwise_result_read_past_a_prefetch_is_computed_before_it():
    """``computed_where_planned``: a pointwise result that an extern kernel reads after a prefetch goes
    through ``karma.wait`` where the graph computed it (Inductor then stores it there, not when the matmul is
    lowered, after the prefetch has allocated); one read before the prefetch already is stored, and the graph
    computes the same values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from karma_fx.passes.rewrite import computed_where_planned

    def step(a, host, b):
        doubled = a * 2  # read by the matmul after the prefetch: pinned
        early = torch.mm(b + 1, b)  # its pointwise input is read before the prefetch: left alone
        fetched = torch.ops.karma.prefetch(host, torch.device("cpu"))
        return torch.mm(doubled, torch.ops.karma.wait(fetched)), early

    args = (torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    gm = make_fx(step)(*args)
    assert computed_where_planned(gm) == 1
    wait = torch.ops.karma.wait.default
    pinned = [n for n in gm.graph.nodes if n.target is wait and n.args[0].target is torch.ops.aten.mul.Tensor]
    assert len(pinned) == 1 and pinned[0].prev is pinned[0].args[0]
    assert [u.target for u in pinned[0].args[0].users] == [wait]
    torch.testing.assert_close(gm(*args), step(*args))
    plain = make_fx(lambda a, b: torch.mm(a * 2, b))(args[0], args[2])
    assert computed_where_planned(plain) == 0

    def two_results(a, host):  # a pointwise op with two outputs (read through getitem) is left alone
        mantissa, _ = torch.frexp(a)
        return torch.mm(mantissa, torch.ops.karma.wait(torch.ops.karma.prefetch(host, torch.device("cpu"))))

    gm = make_fx(two_results)(*args[:2])
    computed_where_planned(gm)
    torch.testing.assert_close(gm(*args[:2]), two_results(*args[:2]))

    def rebuilt(a, b, c):  # a recomputation is a boundary too; a matmul read by an add is lowered at the add
        doubled = a * 2
        product = torch.mm(doubled, b)
        return product + c.sin()

    gm = make_fx(rebuilt)(*args)
    sin = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sin.default)
    sin.meta["karma"] = {"recompute_of": "sin"}
    assert computed_where_planned(gm) == 1
    assert next(n for n in gm.graph.nodes if n.target is wait).args[0].target is torch.ops.aten.mul.Tensor
    torch.testing.assert_close(gm(*args), rebuilt(*args))

    gm = make_fx(step)(*args)  # a recomputed result read past a prefetch is pinned as any other
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.mul.Tensor:
            node.meta["karma"] = {"recompute_of": node.name}
    assert computed_where_planned(gm) == 1


def test_a_recomputation_ending_in_loops_ends_its_function():
    """``recomputations_end_their_functions``: each tensor a recomputation rebuilds with loops for the backward
    (a ``tanh`` and a ``sigmoid`` of a rebuilt matmul, a ``var_mean``'s mean, a ``sigmoid`` of a view) is read
    through ``karma.wait`` placed just after it, so that Inductor ends the function of loops there, before the
    backward's loops that read it; a recomputation starting with loops right after other loops begins a function
    of its own. A value only the recomputation reads (a ``sin`` a rebuilt matmul reads, a product read through a
    view by a rebuilt ``sigmoid``) is left alone, and the graph computes the same values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from karma_fx.passes.rewrite import recomputations_end_their_functions

    def step(x, w, g):
        m = torch.mm(x, w)  # rebuilt: a matmul, then loops
        t = m.tanh()
        s = t.sigmoid()
        _, mean = torch.var_mean(m, dim=1)
        u = (m * 2).view(-1).sigmoid()
        h = g * t * s * mean[:, None] * u.view(4, 4)
        late = torch.mm(t.sin(), w)  # rebuilt, ending with a matmul
        return h, torch.mm(late, w)

    args = (torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    gm = make_fx(step)(*args)
    aten, wait = torch.ops.aten, torch.ops.karma.wait.default
    rebuilt = (aten.tanh.default, aten.sigmoid.default, aten.sin.default, aten.var_mean.correction)
    for node in gm.graph.nodes:
        if node.target in rebuilt or (node.target is aten.mul.Tensor and node.args[1] == 2) or (
                node.target is aten.mm.default and node.args[0].op == "placeholder" and node.args[0].name == "x_1"):
            node.meta["karma"] = {"recompute_of": node.name}
    mm_late = next(n for n in gm.graph.nodes if n.target is aten.sin.default).next
    mm_late.meta["karma"] = {"recompute_of": mm_late.name}
    assert recomputations_end_their_functions(gm) == 5
    waits = [n for n in gm.graph.nodes if n.target is wait]
    assert [w.args[0].target for w in waits] == [aten.tanh.default, aten.sigmoid.default, operator.getitem,
                                                 aten.sigmoid.default, wait]
    assert waits[2].args[0].args[1] == 1  # the mean, not the variance no one reads
    assert all(w.prev is w.args[0] for w in waits[:4])  # just after what it pins
    # the rebuilt ``sin`` comes right after the backward's product (loops): it reads a buffer through a wait,
    # which begins a function of its own
    assert waits[4].args[0] is waits[0] and [u.target for u in waits[4].users] == [aten.sin.default]
    assert waits[4].next.target is aten.sin.default
    assert [u.target for u in waits[0].args[0].users] == [wait]  # every later reader reads the pinned value
    assert {u.target for u in waits[0].users} == {aten.sigmoid.default, aten.mul.Tensor, wait}
    torch.testing.assert_close(gm(*args), step(*args))
    plain = make_fx(step)(*args)
    assert recomputations_end_their_functions(plain) == 0


@pytest.mark.parametrize("budget", ["4.63MiB", "3.9MiB", 0.6])
def test_convolutions_split_along_the_batch_under_inductor(budget):
    """A small CNN whose floor was a CPU convolution backward's scratch, compiled by Inductor (the default
    compiler) at 4.63 MiB, where it was refused: the plan splits convolutions along the batch (karma ops, which
    Inductor calls as they are), the step trains as eager does (relative 1e-5) and a steady step peaks within
    the plan and the budget. In bytes: it was 0.6 of the step as written until that step was counted as it runs
    channels-last (6.37 MB, not 8.09). At 3.9 MiB, near its floor, the plan offloads three activations and ran
    10% above its model (4.02 MiB against 3.66) until each BatchNorm backward's output was computed before
    the next convolution's input is prefetched (``passes.rewrite.computed_where_planned``). At 0.6 of the
    step as written it was refused (its floor 0.5% above) until the split backward computed each piece's input
    gradient in a call of its own (``karma_fx.split_ops``)."""
    model, compiled, x = small_cnn_trained_as_eager(budget=budget)
    assert compiled.plan.splits and compiled.plan.fits
    assert_measured_within_plan(model, compiled, (x,), {}, slack=0.01)


def small_cnn_trained_as_eager(**options):
    """``tests/test_split.py``'s small CNN compiled by Inductor with ``options``, two steps trained beside eager
    with every gradient compared (relative 1e-5); returns the model, the compiled step and the batch."""
    from test_split import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    return model, trained_as_eager(model, x, y, **options), x


def trained_as_eager(model, x, y, **options):
    """``model`` compiled by Inductor with ``options``, two cross-entropy steps on ``(x, y)`` trained beside an
    eager copy with every gradient compared (relative 1e-5); returns the compiled step."""
    ref = copy.deepcopy(model)
    compiled = karma_fx.compile(model, compiler="inductor", **options)
    for _ in range(2):
        for m, run in ((model, compiled), (ref, ref)):
            m.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(run(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    return compiled


def test_the_host_optimizer_runs_in_inductor_compiled_backward_graphs():
    """``optimizer=`` under Inductor: the backward graph Inductor compiles hands each gradient to the host
    AdamW (``karma::gradient_ready``, an extern kernel), and the parameters after three steps equal those of
    the same plan compiled by Inductor without the pipeline, with torch.optim.AdamW stepped after backward.
    A plan that moves tensors and splits a convolution (the CNN at 560 KiB, about 0.7 of its peak, in bytes: a
    fraction would be of two different steps, the pipeline's partition as planned and Inductor's own for the
    other; roofline costs so both plan alike)."""
    import functools

    from torch._inductor.utils import run_and_get_code

    model, args, kwargs = build("cnn", "tiny")
    reference = copy.deepcopy(model)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    step = karma_fx.compile(model, budget="560KiB", compiler="inductor", costs="roofline", optimizer=adamw,
                            bucket_bytes=4096)
    plain = karma_fx.compile(reference, budget="560KiB", compiler="inductor", costs="roofline")
    ordinary = adamw(reference.parameters())
    for i in range(3):
        torch.manual_seed(i)  # the same dropout masks
        _, code = run_and_get_code(lambda: output_to_loss(step(*args, **kwargs)).backward())
        if i == 0:
            assert any("torch.ops.karma.gradient_ready" in c for c in code), "the hand-over is compiled"
        torch.manual_seed(i)
        output_to_loss(plain(*args, **kwargs)).backward()
        if i == 0:  # planned alike while neither holds optimizer state on the device (from the first update on,
            planned = step.plan, plain.plan  # plain's steps hold AdamW's, the pipeline's is host memory)
        ordinary.step()
        ordinary.zero_grad()
    step.pipeline.wait_updates()
    # the same plan; the unplanned step each names is its own (the pipeline's partition, Inductor's for plain)
    assert planned[0].decisions and planned[0].replace(unplanned_peak_bytes=0) == planned[1].replace(
        unplanned_peak_bytes=0) and len(step.pipeline.buckets) > 1
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is None, f"{n}: the host optimizer consumed its gradient"
        assert torch.allclose(p, q, rtol=0, atol=1e-6 * q.abs().max().item()), n


def test_a_deleted_model_compiled_by_inductor_frees_its_weights_and_optimizer():
    """Inductor keeps a copy of the first configuration it serialises for the life of the process, the
    partitioner karma hands it included; the partitioner held the region's partition function, which closes
    over the region's first inputs: the first model compiled in a process kept its weights after ``del`` and
    ``torch._dynamo.reset()``. A partitioner now holds a key, released when the region is compiled."""
    import functools
    import gc
    import weakref

    from karma_fx import inductor

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    weight = weakref.ref(model[0].weight)
    step = karma_fx.compile(model, budget=1.0, compiler="inductor",
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    step(torch.randn(16, 8)).sum().backward()
    step.pipeline.wait_updates()
    assert inductor._partitions == {}, "every compiled region let go of its partition function"
    del model, step
    torch._dynamo.reset()
    gc.collect()
    assert weight() is None


class _ReadsWeightLate(torch.nn.Module):
    """A weight read elementwise: Inductor computes ``grad * w`` inside a later kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.w = torch.nn.Parameter(torch.randn(16))
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(torch.tanh(self.l1(x)) * self.w))


class _ReadsGradientOn(torch.nn.Module):
    """A bias added to a tensor of its own shape: its gradient is also the gradient that flows on."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.b = torch.nn.Parameter(torch.randn(4, 16))
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(torch.tanh(self.l1(x)) + self.b))


@pytest.mark.parametrize("build_model, update_at_once", [(_ReadsWeightLate, True), (_ReadsGradientOn, False)])
def test_the_hand_over_follows_every_read_of_its_parameter_and_gradient(monkeypatch, build_model, update_at_once):
    """Under Inductor the hand-over must come after every read of the parameter (a pointwise read is computed
    inside whichever kernel reads its result: ``grad * w`` ran after ``w``'s hand-over and read the updated
    weight) and after every read of the gradient (Inductor wrote the next kernel's result into the buffer of a
    gradient the pipeline held until the end of backward, in one bucket). For the first, each host update is
    made to finish before backward goes on, so a late read sees it. One SGD step equals eager's."""
    import functools

    from karma_fx import exchange

    ready = exchange.GradientPipeline.ready

    def ready_then_update(self, grad, param):
        ready(self, grad, param)
        for future in list(self._pending):
            future.result()

    if update_at_once:
        monkeypatch.setattr(exchange.GradientPipeline, "ready", ready_then_update)
    torch.manual_seed(0)
    model = build_model()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    sgd = functools.partial(torch.optim.SGD, lr=1.0)
    step = karma_fx.compile(model, budget=1.0, compiler="inductor", optimizer=sgd,
                            bucket_bytes=1 if update_at_once else 1 << 20)
    step(x).pow(2).sum().backward()
    step.pipeline.wait_updates()
    opt = sgd(reference.parameters())
    reference(x).pow(2).sum().backward()
    opt.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), (n, (p - q).abs().max().item())


def test_before_torch_2_10_the_pipeline_doors_run_op_by_op(monkeypatch):
    """Inductor before 2.10 drops an extern kernel that returns nothing and mutates nothing: the hand-over
    would vanish and the parameters silently never update. There the pipeline doors default to the op-by-op
    compiler, and asking for Inductor with them is refused."""
    from karma_fx import compiler
    from karma_fx.errors import UnsupportedModelError

    monkeypatch.delenv("KARMA_COMPILER")
    assert compiler.inductor_keeps_hand_overs() == (torch.__version__ >= "2.10")
    monkeypatch.setattr(compiler, "inductor_keeps_hand_overs", lambda: False)
    step = karma_fx.compile(torch.nn.Linear(2, 2), budget=1.0, optimizer=torch.optim.SGD)
    assert step._made_with[0].compiler == "eager"
    assert karma_fx.compile(torch.nn.Linear(2, 2), budget=1.0)._made_with[0].compiler == "inductor"
    with pytest.raises(UnsupportedModelError, match="from torch 2.10 on"):
        karma_fx.compile(torch.nn.Linear(2, 2), budget=1.0, compiler="inductor", data_parallel=True)


def test_the_step_inductor_runs_swaps_no_tensor_the_backward_makes():
    """The leanest plan's backward swaps (``leanest.backward_swaps``) are for steps run op by op: Inductor may
    split a reader's kernel and run its second half, reading the fetched tensor and the saved tensors that half
    reads, after the peak (a layer norm's backward split around a heavy branch measured 256 KiB above its plan,
    19% over its budget at the floor). The problem of an Inductor step says so, and gets none."""
    from karma_fx.strategies.leanest import backward_swaps

    torch.manual_seed(0)
    model, args, kwargs = build("gpt2", "tiny", dropout=0.0)
    eager = karma_fx.prepare(model, args, kwargs, compiler="eager", costs="roofline", loss_chunk=16)
    inductor = karma_fx.prepare(model, args, kwargs, compiler="inductor", costs="roofline", loss_chunk=16)
    assert not eager.problem.fused_kernels and backward_swaps(eager.problem)
    assert inductor.problem.fused_kernels and backward_swaps(inductor.problem) == ()


class WideKernels(torch.nn.Module):
    """3x3 convolutions whose weights outweigh their activations (as ResNet-50's do at tiny size), a 1x1
    convolution (its weight is channels-last already), a flatten and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 32, 1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.body(x), 1)).square().mean()


class MeanHead(torch.nn.Module):
    """Two 3x3 convolutions and a global mean into a linear head: the gradient reaching the last convolution's
    backward comes from the mean's, channels-first, and is copied to channels-last by the kernel that makes it."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b(torch.relu(self.a(x))))
        return self.head(x.mean((2, 3))).square().mean()


class PooledHead(torch.nn.Module):
    """A DenseNet-style transition before the mean: a 1x1 convolution and an average pooling. The pooling's
    backward reads the convolution's output for its sizes only, so Inductor never frees that saved tensor and
    holds it to the backward's end, where the model freed it at the gradient's channels-last copy (a
    DenseNet-style probe ran 5.3% above its predicted step)."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1, bias=False), nn.BatchNorm2d(24), nn.ReLU(),
                                  nn.Conv2d(24, 16, 1), nn.AvgPool2d(2))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3))).square().mean()


@pytest.mark.parametrize("make", [WideKernels, MeanHead, PooledHead], ids=["wide-kernels", "mean-head", "pooled-head"])
def test_a_cnn_step_as_written_runs_channels_last_and_is_predicted_so(make):
    """On a CPU Inductor runs a step with convolutions channels-last (its layout optimization): it copies the
    weights and the batch to channels-last at the forward's start and saves the copies, its convolutions'
    scratch is oneDNN's channels-last scratch (larger for a weight's gradient, smaller for a channels-first
    activation), autograd copies each weight's channels-last gradient into the weight's layout after the
    backward, and a gradient from the head's (``MeanHead``) is written channels-first and copied channels-last
    by one kernel. Karma's ``budget=1.0`` step is that step (``torch.compile``'s peak, to the byte) and its
    predicted peak counts all four (before: 17% and 27% under what ran; ResNet-50 at tiny size 14%)."""
    from karma_fx.measure_run import measure_step_peak

    peaks = []
    for door in ("karma", "torch"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = make(), torch.randn(2 if make is WideKernels else 4, 3, 16 if make is WideKernels else 32,
                                       16 if make is WideKernels else 32)
        compiled = (karma_fx.compile(model, budget=1.0, compiler="inductor") if door == "karma"
                    else torch.compile(model, backend="inductor", dynamic=False))
        for _ in range(2):
            compiled(x).backward()
            for p in model.parameters():
                p.grad = None
        if door == "karma":
            excess = compiled.regions[0].prepared.keep_all_excess
            assert excess.channels_last and dict(excess.scratch), excess
            assert compiled.plan.status == "KEEP" and compiled.regions[0].last.inductors_own
            assert_measured_within_plan(model, compiled, (x,), {}, below=0.02)
        peaks.append(measure_step_peak(model, compiled, (x,), {}, lambda loss: loss).peak_bytes)
    assert peaks[0] == peaks[1]


class PreActivationHead(torch.nn.Module):
    """A residual block with a projection shortcut, then a batch norm, ReLU and global mean into a linear head
    (a pre-activation ResNet's end): the head's batch norm reads the residual sum, which Inductor stores
    channels-last, so the gradient it makes for the last convolution's backward is written channels-last."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.p, self.bn, self.head = nn.Conv2d(3, 16, 1, bias=False), nn.BatchNorm2d(16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.p(x) + self.b(torch.relu(self.a(x)))
        return self.head(torch.relu(self.bn(h)).mean((2, 3))).square().mean()


@pytest.mark.parametrize("make, copies", [(MeanHead, 1), (PreActivationHead, 0)], ids=["mean-head", "pre-activation"])
def test_the_heads_gradient_is_copied_channels_last_only_where_its_kernel_reads_channels_first(make, copies):
    """The model of the step as written copies the head's gradient to channels-last for the last convolution's
    backward where Inductor does: ``MeanHead``'s kernel reads only the saved ReLU mask, which Inductor stores
    channels-first (made after the last convolution from it alone), a pre-activation head's reads the residual
    sum, stored channels-last (read off both steps' generated code). Counted on both, tiny WRN-28-10's allocator
    peak measured 2.8% under its prediction, 1.5% without the second copy (``bench/inductor_peaks.py``)."""
    from karma_fx.fusion import stitched
    from karma_fx.inductor import min_cut_partition
    from karma_fx.passes.capture import capture
    from karma_fx.passes.fusible import channels_last_nodes, with_channels_last_copies

    torch.manual_seed(0)
    step = capture(make(), (torch.randn(2, 3, 16, 16),), inductor=True)
    fw, bw = min_cut_partition(step.joint, step.joint_inputs, as_written=True, num_fwd_outputs=step.num_fwd_outputs)
    joint, _ = with_channels_last_copies(stitched(fw, bw, step.num_fwd_outputs), step.num_fwd_outputs,
                                         channels_last_nodes(fw))
    copied = [n for n in joint.graph.nodes if n.meta.get("karma", {}).get("channels_last_copy")
              and any(u.target is torch.ops.aten.convolution_backward.default for u in n.users)]
    assert len(copied) == copies


@pytest.mark.parametrize("held_to_the_end", [True, False], ids=["torch<2.13", "torch>=2.13"])
def test_a_tangent_lives_to_the_backwards_end_where_torch_holds_it(monkeypatch, held_to_the_end):
    """Before torch 2.13 AOTAutograd keeps the backward's tangents until the backward graph returns (a GPT-2
    returning its logits beside the loss: the logits' tangent, zeros for the unused output, held to the end; 3.0%
    of the step on torch 2.9, 16% on a GPU under 2.11, where the model freed it at its last read); 2.13 frees each
    after its last reader. Counted as the running torch does, in every Inductor problem."""
    import karma_fx.fusion as fusion
    from karma_fx.problem import Op, Problem, Storage

    monkeypatch.setattr(fusion, "TANGENTS_HELD_TO_THE_END", held_to_the_end)
    mb = 1 << 20
    ops = (Op("mm", "aten.mm.default", "fwd", ("x", "w"), ("mm",)),
           Op("mm_1", "aten.mm.default", "bwd", ("tangents_1", "w"), ("mm_1",)),
           Op("mm_2", "aten.mm.default", "bwd", ("mm_1", "x"), ("mm_2",)))
    storages = (Storage("x", mb, "input", None, (0, 2)), Storage("w", mb, "param", None, (0, 1)),
                Storage("mm", 4 * mb, "activation", 0, (), is_output=True),
                Storage("tangents_1", 4 * mb, "tangent", None, (1,), arrives_at=1),
                Storage("mm_1", mb, "activation", 1, (2,)), Storage("mm_2", mb, "gradient", 2, (), is_output=True))
    held = fusion.inductor_problem(Problem(ops=ops, storages=storages, num_fwd_ops=1), fusible=(), inlined=())
    assert held.storage("tangents_1").users == ((1, 2) if held_to_the_end else (1,))


def test_reductions_are_known_without_torchs_reduction_tag(monkeypatch):
    """torch 2.9 has no ``torch.Tag.reduction``: every Inductor step failed there with an ``AttributeError``.
    Reductions are then known by name, the same ops torch 2.13 tags."""
    from karma_fx.passes import fusible

    monkeypatch.setattr(fusible, "_REDUCTION_TAG", None)
    aten = torch.ops.aten
    for op in (aten.sum.dim_IntList, aten.amax.default, aten.var_mean.correction):
        assert fusible._computes_in_loops(op) and fusible._stores_its_result(op), op
    assert fusible._computes_in_loops(aten.add.Tensor) and not fusible._stores_its_result(aten.add.Tensor)
    assert not fusible._computes_in_loops(aten.mm.default)
    if hasattr(torch.Tag, "reduction"):  # where this torch has the tag, every op named carries it
        for name in fusible._REDUCTIONS:
            _, packet, overload = name.split(".")
            assert torch.Tag.reduction in getattr(getattr(aten, packet), overload).tags, name


@pytest.mark.parametrize("budget", [1.0, 0.9, 0.6])
def test_a_step_updating_views_in_place_peaks_at_its_plan(budget):
    """The in-place-views probe model of ``bench/budget_probes.py`` (blocks that update views of their
    activation in place: functionalized, each update is a scatter into the tensor, its backward a chain of
    copies and scatters) trains as eager and peaks within 0.5% of its plan, the step as written (``budget=1.0``)
    and plans at 0.9 and 0.6. At 0.6 the plan rebuilds three blocks (a matmul and its chain) in the backward:
    Inductor fused each rebuilt chain with the backward's loops that read it into one function holding the
    rebuilt matmul's output, the rebuilt tensors and the backward's outputs together, 9.0% above the plan and
    5.7% past the budget; each rebuild now ends its own function
    (``passes.rewrite.recomputations_end_their_functions``) and the simulator holds what that function reads
    and writes until it ends. Before: the step as written measured 10.7% above its model and planned steps broke the
    budget by 7% (the in-place-views probe of ``bench/budget_probes.py``), for four reasons: (1) a view whose
    traced value has a storage of its own was counted as a buffer beside its base (``passes.liveness``);
    (2) Inductor writes ``copy`` and ``select_scatter`` as loops, which the model took for extern kernels that
    end a function of loops (``passes.fusible``); (3) an empty buffer nothing reads, which Inductor drops, was
    counted and ended one too (``fusion.loop_runs``); (4) a recomputation the plan put after that chain ran in
    the chain's function, allocated with its buffers (``passes.rewrite.computed_where_planned``)."""
    from helpers import load_bench

    torch.manual_seed(0)
    model = load_bench("budget_probes").InPlaceViews()
    x, y = torch.randn(1024, 64), torch.randint(0, 8, (1024,))
    # below it on roofline costs: a plan chosen by the step's timings varies between runs (at 0.6 a plan that
    # rebuilds whole blocks, as the roofline one does, was chosen in some runs and not in others)
    compiled = trained_as_eager(model, x, y, budget=budget, **({} if budget == 1.0 else dict(costs="roofline")))
    assert (compiled.plan.status == "KEEP") == (budget == 1.0), compiled.plan.status
    loss = lambda out: torch.nn.functional.cross_entropy(out, y)  # noqa: E731
    # 32-64 KiB (0.25-0.4%) above the plan, one or two logits-sized buffers around the loss: not found yet
    if budget == 1.0:
        from karma_fx.measure_run import measure_step_peak

        measured = measure_step_peak(model, compiled, (x,), {}, loss).peak_bytes
        assert abs(measured / compiled.predicted_peak_bytes - 1) < 0.005, (measured, compiled.predicted_peak_bytes)
    else:
        assert_measured_within_plan(model, compiled, (x,), {}, below=0.01, slack=0.005, loss=loss)


class _ScatteredViews(torch.nn.Module):
    """Reads an activation through ``split``, ``cat`` and ``as_strided`` views and multiplies an ``unfold`` view
    of another in place: min-cut saves the zero fill the backward scatters the unfold's gradient into."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(64, d), torch.nn.Linear(d, d), torch.nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        a, b = torch.split(h, [32, h.shape[1] - 32], dim=1)
        hh = torch.cat([b, a], 1)
        w = hh.as_strided((hh.shape[0], 64), (hh.shape[1], 1))
        z = self.b(hh) * torch.cat([w, w], 1).sigmoid()
        z.unfold(1, 4, 4)[:, :, 0].mul_(3.0)
        return self.c(z)


@pytest.mark.parametrize("budget", [1.0, 0.9])
def test_a_backward_scattering_into_a_saved_fill_peaks_at_its_plan(budget):
    """The step as written of a model whose backward scatters a matmul's output into a saved zero fill, in one
    C++ function with two more 256 KiB outputs, is predicted within 0.5% of its measured peak, and a plan below
    it holds. The model had two errors there (11.3% under): the scatter was written over the matmul's output
    (Inductor writes it over the fill it scatters into: ``fusion.written_in_place``), and what the function
    read was freed at its last reader, not when the function returns (``fusion.inputs_held_through_runs``). A
    plan that recomputed one tensor peaked 11% above its prediction, past its budget, for the second reason."""
    from karma_fx.measure_run import measure_step_peak

    torch.manual_seed(0)
    model = _ScatteredViews()
    x, y = torch.randn(512, 64), torch.randint(0, 8, (512,))
    # below it, greedy: after other tests in the process cpsat chose offloads, where an over-count of another
    # kind (since mended) set the plan's peak; greedy recomputes one tensor. On roofline times: on measured ones
    # a loaded CI worker's greedy chose otherwise, and that plan measured 11% under its prediction
    options = {} if budget == 1.0 else dict(strategy="greedy", costs="roofline")
    compiled = trained_as_eager(model, x, y, budget=budget, **options)
    loss = lambda out: torch.nn.functional.cross_entropy(out, y)  # noqa: E731
    if budget == 1.0:
        measured = measure_step_peak(model, compiled, (x,), {}, loss).peak_bytes
        assert abs(measured / compiled.predicted_peak_bytes - 1) < 0.005, (measured, compiled.predicted_peak_bytes)
    else:
        assert compiled.plan.status != "KEEP", compiled.plan.status
        assert_measured_within_plan(model, compiled, (x,), {}, below=0.01, slack=0.005, loss=loss)


@pytest.mark.parametrize("budget", [1.0, 0.8])
def test_batchnorm_statistics_count_one_batch_a_step(budget):
    """A BatchNorm's running statistics after two steps are eager's, at a budget where nothing moves and at one
    where the plan offloads. Inductor's graphs write them into the model's buffers (``copy_``): the planning
    runs of the first step wrote into those buffers too (three batches counted after one step), and a planned
    step wrote them in the forward and again in the backward graph (two a step)."""
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    ref = copy.deepcopy(model)
    compiled = karma_fx.compile(model, budget=budget, compiler="inductor")
    for _ in range(2):
        x = torch.randn(512, 16)
        for m, run in ((model, compiled), (ref, ref)):
            m.zero_grad(set_to_none=True)
            run(x).sum().backward()
    assert bool(compiled.plan.decisions) == (budget < 1.0)
    for name, mine in model[1].named_buffers():
        torch.testing.assert_close(mine, dict(ref[1].named_buffers())[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("budget", [1.0, 0.7])
def test_a_result_a_matmul_reads_through_a_view_is_computed_again_where_loops_read_it(budget):
    """Inductor stores the 2-D view a matmul reads of a pointwise result, not the result, and computes the result again
    in each loop that reads it (the two-pass MLP's backward starts with ``2 * x * g / n``, which a matmul reads as a
    2-D view and a residual gradient a block later as it is), so what it is computed from stays allocated until then
    (``passes.fusible.inlined_past_views``): the two-pass MLP's steps, as written and planned, peak at their
    prediction (without that rule 2.2% and 3.4% above it; at d=128, 1 MiB: the last residual sum held a block
    longer). Each weight is used twice, so its two gradients are summed, and only the second product runs in the sum
    (``fusion.delayed_matmuls``; with both delayed the step as written was predicted 0.5% under its measured peak,
    and a plan at d=128 72% above its own)."""
    from helpers import load_bench
    from karma_fx.measure_run import measure_step_peak

    torch.manual_seed(0)
    model = load_bench("versus_torch").TwoPassMLP(d=32, blocks=2)  # a block run twice, a loss of squares
    ref = copy.deepcopy(model)
    x = torch.randn(4, 128, 32)
    compiled = karma_fx.compile(model, budget=budget, compiler="inductor", costs="roofline")
    for _ in range(2):
        for m, run in ((model, compiled), (ref, ref)):
            m.zero_grad(set_to_none=True)
            run(x).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    measured = measure_step_peak(model, compiled, (x,), {}, lambda out: out).peak_bytes
    if budget != 1.0:
        assert compiled.plan.status != "KEEP", compiled.plan.status
    assert abs(measured / compiled.predicted_peak_bytes - 1) < 0.005, (measured, compiled.predicted_peak_bytes)


def _scalar_scaled(x, g, w):  # one read at a varying index (g is a scalar), the 2-D view read by mm and a sum
    n = x * 2 * g
    v = n.view(-1, 64)
    return v @ w, n.sum(-1), v.sum(0)


def _two_reads(x, g, w):  # g of x's shape: two varying reads
    n = x * 2 * g
    v = n.view(-1, 64)
    return v @ w, n.sum(-1), v.sum(0)


def _broadcast(x, g, w):  # g a vector broadcast along the rows: a varying index too
    n = x * g
    v = n.view(-1, 64)
    return v @ w, n.sum(-1), v.sum(0)


def _view_read_by_mm_alone(x, g, w):
    n = x * 2
    v = n.view(-1, 64)
    return v @ w, (n + 1).exp().sum(-1)


def _read_both_ways(x, g, w):  # one loop reads the result and its stored view
    n = x * 2
    v = n.view(-1, 64)
    return v @ w, (n + v.view(n.shape)).sum(-1), v.sum(0)


@pytest.mark.parametrize("fn, g_shape, again", [
    (_scalar_scaled, (), {"sum_1": False}), (_two_reads, (8, 16, 64), None), (_broadcast, (64,), None),
    (_view_read_by_mm_alone, (8, 16, 64), None), (_read_both_ways, (8, 16, 64), {"add": True})])
def test_a_result_is_computed_again_past_its_view_exactly_where_inductor_does_it(fn, g_shape, again):
    """``inlined_past_views`` against the code Inductor generates: where it names a result, Inductor stores only
    the 2-D view (no buffer of the result's own shape) and computes the result again in the loops named; where
    it names none, Inductor stores the result itself (two reads at a varying index, a broadcast vector, a view
    only the matmul reads: the review found the rule first claimed all three)."""
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from karma_fx.passes.fusible import inlined_past_views

    args = (torch.randn(8, 16, 64), torch.randn(g_shape), torch.randn(64, 64))
    named = inlined_past_views(make_fx(fn)(*args).graph)
    torch._dynamo.reset()
    _, (code, *_) = run_and_get_code(torch.compile(fn, backend="inductor"), *args)
    whole = "empty_strided_cpu((8, 16, 64)" in code
    assert whole == (again is None), code
    assert list(named.values()) == ([] if again is None else [again]), named


class GeluMLP(torch.nn.Module):
    """Linear d→4d, GELU, Linear 4d→d, a loss of the output's squares: the GELU's output is read first in the
    backward by its weight's gradient (a matmul), its input by the GELU's own backward after that matmul."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x))).square().mean()


class RebuildTheGelu:
    """A strategy that rebuilds the GELU's output (the largest ``mul`` the backward reads) from its input."""

    name = "rebuild-gelu"

    def __call__(self, problem, costs, budget):
        from karma_fx.plan import Plan
        from karma_fx.strategies.base import RecomputeBuilder, saved_gaps

        gaps = [g for g in saved_gaps(problem) if problem.ops[g.storage.producer].target == "aten.mul.Tensor"]
        gap = max(gaps, key=lambda g: g.storage.size_bytes)
        return Plan(strategy=self.name, budget_bytes=budget,
                    decisions=(RecomputeBuilder(problem).group([gap], {gap.storage.name}),))


@pytest.mark.parametrize("joined", [True, False])
def test_a_rebuilt_gelu_runs_in_one_kernel_with_its_backward(joined, monkeypatch):
    """The rebuilt GELU is first read by its weight's gradient, a matmul, and its backward (reading the same
    input) comes after it: run where the plan put them, they were two kernels each computing the same ``erf``
    (a two-pass MLP's plan of PyTorch's recompute set ran 1.07x PyTorch's step on a CPU). Joined
    (``karma_fx.joins``), the GELU's backward moves up to the rebuild and Inductor fuses them: one kernel holds
    both (``joined=False``: ``with_joins`` switched off, the two kernels of before). Either way the step trains as
    eager and peaks within its plan."""
    from torch._inductor.utils import run_and_get_code

    if not joined:
        monkeypatch.setattr(karma_fx.simulate, "with_joins", lambda problem, decisions, budget, peak: decisions)
    torch.manual_seed(0)
    model, x = GeluMLP(), torch.randn(4, 64, 32)
    reference = copy.deepcopy(model)
    compiled = karma_fx.compile(model, budget="1GiB", strategy=RebuildTheGelu(), compiler="inductor")
    _, code = run_and_get_code(lambda: compiled(x).backward())
    reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    (rebuild,) = compiled.plan.decisions
    assert bool(rebuild.joins) == joined, rebuild
    kernels = set(re.findall(r"cpp_fused_\w+", code[-1]))
    both = [k for k in kernels if "gelu_backward" in k and "gelu" in k.replace("gelu_backward", "")]
    assert bool(both) == joined, sorted(kernels)
    model.zero_grad(set_to_none=True)
    assert_measured_within_plan(model, compiled, (x,), {}, loss=lambda out: out)


def test_logits_beside_the_loss_are_detached_under_inductor_and_the_step_equals_eager():
    """An HF-style (loss, logits) output under Inductor: after the first step the logits are returned detached
    (``karma_fx.unused_grads``), their zero gradient and the head's backward on it gone; every step equals eager."""
    class LossAndLogits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mid, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 512, bias=False)

        def forward(self, x, y):
            logits = self.head(torch.tanh(self.mid(x)))
            return torch.nn.functional.cross_entropy(logits, y), logits

    model = LossAndLogits()
    ref = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1.0, compiler="inductor")
    x, y = torch.randn(256, 16), torch.randint(0, 512, (256,))
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss, logits = step(x, y)
        loss.backward()
        loss_ref, logits_ref = ref(x, y)
        loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert step._session.regions[0].detached == (1,)
    _, bw = step._session.regions[0].graphs
    assert not [n for n in bw.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")][1:]


class ResidualMLP(torch.nn.Module):
    """``h = LayerNorm(GELU(Linear(h))) + h``, four times: a rebuilt block adds its input, which the forward also
    saves as the 2-D view its weight's gradient reads."""

    def __init__(self, d: int = 64, h: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.first = torch.nn.Linear(d, h)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(h) for _ in range(layers))
        self.last = torch.nn.Linear(h, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.first(x))
        for linear, norm in zip(self.hidden, self.norms):
            h = norm(torch.nn.functional.gelu(linear(h))) + h
        return self.last(h)


class RebuildAResidualSum:
    """A strategy that rebuilds one residual sum of the middle of the network from the sum before it."""

    name = "rebuild-a-residual-sum"

    def __call__(self, problem, costs, budget):
        from karma_fx.plan import Plan
        from karma_fx.strategies.base import RecomputeBuilder, saved_gaps

        sums = [g for g in saved_gaps(problem) if problem.ops[g.storage.producer].target == "aten.add.Tensor"]
        gap = sums[len(sums) // 2]
        return Plan(strategy=self.name, budget_bytes=budget,
                    decisions=(RecomputeBuilder(problem).group([gap], {gap.storage.name}),))


def test_saved_tensors_sharing_a_storage_are_not_written_over_in_the_backward():
    """A residual MLP whose plan rebuilds a residual sum in the backward from the sum before it: its forward saves
    that sum and the 2-D view of it a weight's gradient reads, two backward inputs on one storage. AOTAutograd donated both to the backward (it checks a saved
    tensor against the step's inputs and outputs, not against the other saved tensors), and Inductor wrote
    the rebuilt next sum over the first: the weight's gradient, read through the view, came out 70% off
    eager's with the loss unchanged. Now neither is donated, and every gradient equals eager's."""
    from karma_fx.passes.liveness import storage_key

    torch.manual_seed(0)
    model = ResidualMLP()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 64, 64), torch.randint(0, 10, (8, 64))
    compiled = karma_fx.compile(model, budget="8MiB", strategy=RebuildAResidualSum(), compiler="inductor",
                                costs="roofline")
    loss = torch.nn.functional.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
    loss.backward()
    expected = torch.nn.functional.cross_entropy(reference(x).flatten(0, 1), y.flatten())
    expected.backward()
    fw, _ = compiled.regions[0].last.graphs
    saved = next(n for n in fw.graph.nodes if n.op == "output").args[0][1:]
    storages = [storage_key(n.meta["val"]) for n in saved
                if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
    assert len(set(storages)) < len(storages), "the plan no longer saves two tensors of one storage"
    # Inductor's fused reductions need not round as eager's do (the loss differed in its last bit in one CI run)
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() <= 1e-5, name


def test_a_step_as_written_with_attention_dropout_is_predicted_to_its_peak():
    """A 2-layer GPT with dropout on its attention probabilities, nothing moved: Inductor draws each dropout's
    random numbers inside the kernel that compares them, and stores no S×S float buffer for them. Counted as
    stored, the step was predicted 7.0% above its allocator peak."""
    model, args, kwargs = build("megatron_gpt", "tiny", batch=4, seq=128, layers=2, hidden=64, heads=4, vocab=256,
                                dropout=0.1)
    compiled = karma_fx.compile(model, budget=1.0, compiler="inductor")
    steady(compiled, model, args, kwargs)
    assert not compiled.plan.decisions
    assert_measured_within_plan(model, compiled, args, kwargs, below=0.01)


def _bias_added(a, b, c, d):
    return c + a @ b


def _views_added(a, b, c, d):
    return (a @ b).view(4, 16, 64) + (d @ b).view(4, 16, 64)


def _product_read_twice(a, b, c, d):
    y = a @ b
    return c + y, y.sum()


@pytest.mark.parametrize("fn, rewritten", [(_bias_added, True), (_views_added, False), (_product_read_twice, False)])
def test_an_add_becomes_addmm_exactly_where_inductor_rewrites_it(fn, rewritten):
    """``addmm_adds`` against the code Inductor generates: a matmul added to a bias becomes one ``addmm``; two
    matmuls read as 3-D views and summed (a residual block's gradient) stay matmuls whose sum Inductor inlines
    into its readers, as does a matmul something else reads too. The model took every add of a matmul of its
    size for an ``addmm``: a residual MLP's backward held one buffer per block where it holds every block's
    matmul output, and its planned steps ran up to 30% above their predictions."""
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from karma_fx.passes.fusible import addmm_adds

    args = (torch.randn(64, 64), torch.randn(64, 64), torch.randn(64), torch.randn(64, 64))
    named = addmm_adds(make_fx(fn)(*args).graph)
    torch._dynamo.reset()
    _, (code, *_) = run_and_get_code(torch.compile(fn, backend="inductor"), *args)
    assert ("extern_kernels.addmm" in code) == rewritten, code
    assert bool(named) == rewritten, named


class InputDropout(torch.nn.Module):
    """A dropout on an input that needs no gradient (no mask saved), read on both sides of a matmul."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.drop, self.fc = torch.nn.Dropout(0.1), torch.nn.Linear(d, d // 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(x)
        y = self.fc(torch.relu(h))
        return (y + h[:, : y.shape[1]]).sum(-1)


def test_a_random_draw_computed_again_across_a_matmul_is_a_buffer():
    """With no mask saved, Inductor inlines the dropout's comparison into kernels before and after the matmul,
    and both draw from one stored buffer of random numbers (4 MiB here): a draw is kernel-local only where
    everything that computes it again runs in its own stretch of loops. A review's probe, 32% above its
    prediction where the comparison's readers were not followed."""
    torch.manual_seed(0)
    model, x = InputDropout(), torch.randn(4096, 256)
    compiled = karma_fx.compile(model, budget=1.0, strategy="greedy", compiler="inductor")
    steady(compiled, model, (x,), {})
    assert_measured_within_plan(model, compiled, (x,), {}, below=0.01)


def test_pytorchs_activation_memory_budget_knob_leaves_the_step_karma_counts(monkeypatch):
    """``torch._functorch.config.activation_memory_budget`` set in the process made karma's step as written
    min-cut at that fraction, which karma's model does not count: at 0.3 a two-pass MLP ran at 37.07 MiB where the
    model said 34.78, over a budget of 36 MiB for three steps. Karma's partitions now run at the knob's default
    (the plan door and the compiled step count the same step with the knob set or not), a budget the model sets
    for its own graph (``region_activation_memory_budget``, where torch has it) likewise, and a warning says so."""
    import karma_fx.inductor
    from torch._functorch import config as functorch_config

    from karma_fx.measure_run import AllocatorPeak

    monkeypatch.setattr(karma_fx.inductor, "_knob_said", False)
    torch.manual_seed(0)
    model, x = TwoPass(d=64), torch.randn(4, 64, 64)
    plain = karma_fx.prepare(model, (x,), compiler="inductor", costs="roofline").unplanned_peak_bytes
    with functorch_config.patch(activation_memory_budget=0.3):
        with pytest.warns(UserWarning, match=r"budget \(0.3: .* is not applied to the steps karma_fx compiles"):
            knobbed = karma_fx.prepare(model, (x,), compiler="inductor", costs="roofline").unplanned_peak_bytes
        assert knobbed == plain  # 2,105,100 B against 3,287,052 when the knob reached the partition
        compiled = karma_fx.compile(model, budget=1.0, compiler="inductor", costs="roofline")
        for _ in range(2):
            compiled(x).backward()
            model.zero_grad(set_to_none=True)
        with AllocatorPeak(list(model.parameters()), x) as measured:
            compiled(x).backward()
    assert compiled.unplanned_peak_bytes == plain
    assert measured.peak_bytes <= compiled.predicted_peak_bytes
    if hasattr(torch.autograd.graph, "region_activation_memory_budget"):  # torch 2.13

        class Annotated(TwoPass):
            def forward(self, x):
                with torch.autograd.graph.region_activation_memory_budget(0.3):
                    return super().forward(x)

        annotated = Annotated(d=64)
        annotated.load_state_dict(model.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # said once per process, above
            # 2,105,100 B where the annotation reached the partition
            assert karma_fx.prepare(annotated, (x,), compiler="inductor", costs="roofline").unplanned_peak_bytes == plain


class HalvesRotated(torch.nn.Module):
    """A rotary-style layer: the two halves of a projection, each through a pointwise op, concatenated, and the
    projection read again beside it."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a, b = h.chunk(2, dim=-1)
        return (torch.tanh(torch.cat((-2 * b, a.sin()), dim=-1) * h) + x).sum()


class SixteenPieces(torch.nn.Module):
    """A projection cut in sixteen pieces, each scaled through a pointwise op, concatenated again."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = self.fc(x).chunk(16, dim=-1)
        return torch.tanh(torch.cat([p.sin() * (i + 1) for i, p in enumerate(pieces)], dim=-1)).sum()


@pytest.mark.parametrize("make", [HalvesRotated, SixteenPieces])
def test_a_cat_is_one_buffer_its_inputs_are_written_into(make):
    """On a CPU Inductor lowers ``cat`` to a buffer of its own that the loops computing its inputs write their
    slices of (``passes.fusible.CONCATENATIONS``), allocated before them, so no input dies into it. Counted as
    an extern kernel, sixteen pieces were sixteen buffers beside the result (33% above the allocator's peak);
    counted as written over a dying input (the backward's ``cat`` of the halves' gradients), a rotary layer's
    step peaked 24.8% above its prediction."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(8, 256, 128)
    compiled = karma_fx.compile(model, budget=1.0, compiler="inductor", costs="roofline")
    steady(compiled, model, (x,), {})
    assert not compiled.plan.decisions
    assert_measured_within_plan(model, compiled, (x,), {}, below=0.01)


def test_a_refusal_names_the_step_as_written_where_that_is_the_lowest():
    """Sixteen pieces concatenated: every plan that swaps compiles the partition planned, which peaks above
    Inductor's own partition of the step as written (4.13 MiB against 3.13). A refusal named the former as the
    smallest budget that works; it names the step as written, and that budget runs."""
    from karma_fx.errors import InfeasibleBudgetError
    from karma_fx.measure_run import measure_step_peak

    torch.manual_seed(0)
    model, x = SixteenPieces(), torch.randn(8, 256, 128)
    compiled = karma_fx.compile(model, budget=0.85, compiler="inductor", costs="roofline")
    with pytest.raises(InfeasibleBudgetError, match="nothing moved: the step as written") as refused:
        for _ in range(3):
            output_to_loss(compiled(x)).backward()
    floor = refused.value.min_budget_bytes
    assert floor <= compiled.unplanned_peak_bytes * 1.002, (floor, compiled.unplanned_peak_bytes)
    assert compiled.min_budget_bytes <= floor
    torch._dynamo.reset()
    compiled = karma_fx.compile(model, budget=floor, compiler="inductor", costs="roofline")
    steady(compiled, model, (x,), {})
    assert measure_step_peak(model, compiled, (x,), {}, output_to_loss).peak_bytes <= floor


def test_the_step_as_written_writes_a_saved_softmax_over_its_exponentials():
    """A 2-layer GPT at S=256 with 8 heads, nothing moved: Inductor's softmax kernel of the last layer writes the
    probabilities, which the backward reads, into the buffer of the exponentials it reads for the last time (one
    4 MiB buffer, not two). Counted as two, the step as written was predicted 11.5% above its allocator peak, and
    a fraction budget was a fraction of that."""
    model, args, kwargs = build("megatron_gpt", "tiny", batch=2, seq=256, layers=2, hidden=128, heads=8, vocab=256)
    compiled = karma_fx.compile(model, budget=1.0, compiler="inductor", costs="roofline")
    steady(compiled, model, args, kwargs)
    assert not compiled.plan.decisions
    assert_measured_within_plan(model, compiled, args, kwargs, below=0.02)


class _LogitsLM(torch.nn.Module):
    """A language model's head: it returns its logits beside the loss, and Inductor's partition saves them
    for the loss's gradient."""

    def __init__(self, vocab: int = 512, d: int = 64) -> None:
        super().__init__()
        self.emb, self.mix, self.head = (torch.nn.Embedding(vocab, d), torch.nn.Linear(d, d),
                                         torch.nn.Linear(d, vocab))

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.mix(self.emb(ids))))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return loss, logits


def _logits_lm_steps(budget: float) -> tuple["karma_fx.compiler.KarmaModule", int]:
    """``_LogitsLM`` compiled at ``budget``, four steps letting the logits go (``loss_fn(step(...)).backward()``),
    and the allocator's peak of a fifth."""
    from karma_fx.measure_run import measure_step_peak

    torch.manual_seed(0)
    model = _LogitsLM()
    ids, labels = torch.randint(0, 512, (8, 128)), torch.randint(0, 512, (8, 128))
    step = karma_fx.compile(model, budget=budget, compiler="inductor")
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        step(ids, labels)[0].backward()
    return step, measure_step_peak(model, step, (ids, labels), {}, lambda out: out[0]).peak_bytes


def test_logits_the_caller_lets_go_are_freed_by_inductors_backward_as_predicted():
    """``loss_fn(step(...)).backward()`` lets the logits go before the backward; Inductor's step as written
    saved them, and its backward frees them once the loss's gradient has read them. Counted as held to the
    end, the step was predicted 7.6% above the allocator's peak; now to within 0.1%."""
    step, peak = _logits_lm_steps(1.0)
    assert abs(step.predicted_peak_bytes - peak) <= 0.001 * peak, (
        step.predicted_peak_bytes, peak)


def test_a_plan_that_does_not_save_the_logits_counts_them_let_go_and_plans_for_the_room_left():
    """At 0.8 the plan chunks the loss head and saves no logits, where Inductor's own step saved them. The
    step's ledger took whether the backward reads each output from the step as written, so the plan's backward
    counted the 2 MiB of logits the caller had let go (20% over the allocator's peak); and the room left for
    the plan was counted with the step as written's backward (logits released) beside it, so karma planned
    for none and fell back to its leanest plan (four moves where one fits)."""
    step, peak = _logits_lm_steps(0.8)
    assert step.plan.status != "FALLBACK:leanest", step.plan.status
    assert peak <= step.plan.budget_bytes
    assert abs(step.predicted_peak_bytes - peak) <= 0.002 * peak, (step.predicted_peak_bytes, peak)
