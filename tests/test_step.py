"""TrainStep (trainer/step.py) alone, with fakes for the model's wrapper, the optimizer and the captured graph:
accumulation, clipping, the gradient sync's calls, skip-on-NaN, an optimizer that clips itself, the graphed path
and the compile fallback."""

import contextlib

import pytest
import torch
import torch.nn as nn

from trainer.distributed.env import DistEnv
from trainer.distributed.sync import BucketSync, NoSync
from trainer.errors import TrainingError
from trainer.step import GRAPH_AFTER_STEPS, TrainStep

CPU = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)


class Regression(nn.Module):
    """forward(x, y) -> the mean squared error of a linear map: the scalar loss a model returns."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.lin(x).squeeze(-1) - y) ** 2).mean()


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradients each step saw; the step clips for it."""

    clips_grad_norm = False
    before_graph_replay = after_graph_replay = None  # a torch optimizer's (StepOptimizer)

    def __init__(self, params, **kwargs):
        super().__init__(params, lr=0.1, **kwargs)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs, ys = torch.randn(n, 8, 4, generator=g), torch.randn(n, 8, generator=g)
    return lambda micro: (xs[micro], ys[micro])


def _step(model, opt, **kwargs) -> TrainStep:
    args = dict(grad_accum=1, grad_clip=0.0, amp_dtype=None, env=CPU)
    return TrainStep(model, model, opt, **{**args, **kwargs})


def test_accumulation_averages_the_micro_batches_gradients_and_losses():
    """4 micro-batches of 8 accumulate the gradient of the mean loss: the mean of the four micro-batch gradients."""
    model, batch_of = Regression(), _batches(4)
    opt = RecordingSGD(model.parameters())
    out = _step(model, opt, grad_accum=4)(batch_of)
    want_grads, want_losses = [], []
    for micro in range(4):
        ref = Regression()
        loss = ref(*batch_of(micro))
        loss.backward()
        want_losses.append(loss.item())
        want_grads.append([p.grad for p in ref.parameters()])
    for got, *per_micro in zip(opt.seen[0], *want_grads):
        torch.testing.assert_close(got, sum(per_micro) / 4)
    assert out.loss.item() == pytest.approx(sum(want_losses) / 4) and not out.skipped
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step


def test_weighted_micro_batches_scale_each_loss_by_their_weight():
    """Packed documents: each micro-batch ends with its weight (its share of the global batch's targets, times the
    ranks); the gradient is the weighted sum of the micro-batches' gradients and the loss their weighted sum, not the
    mean (the weights 0.1, 0.6 and 0.3 here would give other numbers as 1/3 each)."""
    model, plain = Regression(), _batches(3)
    weights = torch.tensor([0.1, 0.6, 0.3])
    opt = RecordingSGD(model.parameters())
    out = _step(model, opt, grad_accum=3, weighted=True)(lambda micro: (*plain(micro), weights[micro]))
    want_grads, want_loss = [], 0.0
    for micro in range(3):
        ref = Regression()
        loss = ref(*plain(micro))
        (loss * weights[micro]).backward()
        want_loss += loss.item() * weights[micro].item()
        want_grads.append([p.grad for p in ref.parameters()])
    for got, *per_micro in zip(opt.seen[0], *want_grads):
        torch.testing.assert_close(got, sum(per_micro))
    assert out.loss.item() == pytest.approx(want_loss)


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_clipping_reports_the_norm_before_and_clips_to_the_limit(clip):
    model, batch_of = Regression(), _batches(1)
    opt = RecordingSGD(model.parameters())
    out = _step(model, opt, grad_clip=clip)(batch_of)
    ref = Regression()
    ref(*batch_of(0)).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(out.grad_norm, norm)
    seen = torch.nn.utils.get_total_norm(opt.seen[0])
    assert norm > 1e-3  # the limit bites
    torch.testing.assert_close(seen, torch.tensor(clip) if clip else norm, rtol=1e-4, atol=0)


class SyncedModel(nn.Module):
    """The surface of ddp's wrapper that BucketSync calls: no_sync() and finish_grad_sync(norm=...), recorded."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, x, y):
        self.calls.append("forward")
        return self.inner(x, y)

    @contextlib.contextmanager
    def no_sync(self):
        self.calls.append("no_sync")
        yield

    def finish_grad_sync(self, norm: bool):
        self.calls.append(f"finish(norm={norm})")
        return torch.tensor(7.0) if norm else None


def test_the_sync_waits_until_the_last_micro_batch_and_its_norm_is_the_one_reported():
    inner = Regression()
    wrapped = SyncedModel(inner)
    opt = RecordingSGD(inner.parameters())
    step = TrainStep(
        wrapped, inner, opt, grad_accum=3, grad_clip=0.0, amp_dtype=None, env=CPU, sync=BucketSync(wrapped)
    )
    out = step(_batches(3))
    assert wrapped.calls == ["no_sync", "forward", "no_sync", "forward", "forward", "finish(norm=True)"]
    assert out.grad_norm.item() == 7.0  # ddp's norm, computed as the buckets were reduced: not computed again


def test_a_non_finite_step_is_skipped_when_asked_and_the_update_never_runs():
    model = Regression()
    opt = RecordingSGD(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    nan = lambda micro: (torch.full((8, 4), float("nan")), torch.zeros(8))  # noqa: E731
    out = _step(model, opt, skip_non_finite=True)(nan)
    assert out.skipped and opt.seen == []
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    out = _step(model, opt)(nan)  # without skip_non_finite the step runs: the loop stops on the loss it reads
    assert not out.skipped and len(opt.seen) == 1


def test_a_step_above_the_spike_limit_is_skipped_and_the_update_never_runs():
    """train.on_spike=skip: the step compares its loss with the limit before its update; above it, or not finite,
    the update is skipped with the reason; below it, the update runs."""
    model = Regression()
    opt = RecordingSGD(model.parameters())
    batch_of = _batches(1)
    loss = _step(model, opt, grad_accum=1)(batch_of).loss.item()  # an ordinary step: the loss of the batch
    before = [p.detach().clone() for p in model.parameters()]
    opt.seen.clear()
    out = _step(model, opt, spike_limit=lambda: (loss / 2, "half the loss"))(batch_of)
    assert out.skipped.startswith("loss spike: ") and out.skipped.endswith(", half the loss") and opt.seen == []
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    nan = lambda micro: (torch.full((8, 4), float("nan")), torch.zeros(8))  # noqa: E731
    out = _step(model, opt, spike_limit=lambda: (float("inf"), ""))(nan)  # the window not yet full
    assert "is nan" in out.skipped and opt.seen == []
    out = _step(model, opt, spike_limit=lambda: (loss * 2, "twice the loss"))(batch_of)
    assert not out.skipped and len(opt.seen) == 1


def test_the_spike_limit_is_the_mean_plus_sigma_standard_deviations_of_a_full_window():
    from trainer.step import SpikeWatch

    watch = SpikeWatch(window=4, sigma=2.0, action="skip")
    for step, loss in enumerate([1.0, 2.0, 3.0], 1):
        watch.see(step, loss, None)
        assert watch.limit() == (float("inf"), "")  # no spike is called before the window is full
    watch.see(4, 4.0, None)
    limit, what = watch.limit()
    assert limit == pytest.approx(2.5 + 2.0 * (5 / 3) ** 0.5) and what == "the mean + 2 sigma of the last 4"
    watch.see(5, 100.0, None)  # skip: the step skipped it; not raised, and kept out of the window
    assert watch.limit()[0] == pytest.approx(limit)


class SelfClipping(RecordingSGD):
    """An optimizer that computes the norm and clips inside its own step (as the Triton AdamW does)."""

    clips_grad_norm = True

    def grad_norm(self):
        return torch.tensor(3.0)


def test_an_optimizer_that_clips_itself_gives_the_norm_and_its_gradients_are_left_alone():
    model, batch_of = Regression(), _batches(1)
    opt = SelfClipping(model.parameters())
    out = _step(model, opt, grad_clip=1e-3)(batch_of)
    ref = Regression()
    ref(*batch_of(0)).backward()
    assert out.grad_norm.item() == 3.0
    for got, want in zip(opt.seen[0], ref.parameters()):
        torch.testing.assert_close(got, want.grad)  # unclipped: the optimizer's kernel clips


def test_the_graphed_path_captures_after_the_ordinary_steps_and_replays_the_stacked_batch(monkeypatch):
    """CUDA graphs stand in for a fake that runs the captured body at each replay: the body is the whole step
    (forward and backward of every micro-batch, clipping, the update) on the stacked micro-batches."""
    captured = []

    class FakeGraph:
        def __init__(self, body, opt, params, inputs):
            captured.append([t.shape for t in inputs])
            self.body, self.opt = body, opt

        def __call__(self, inputs):
            out = self.body(inputs)
            self.opt.zero_grad(set_to_none=False)  # a graph keeps its gradient buffers
            return out

    monkeypatch.setattr("trainer.compile.graphed.GraphedStep", FakeGraph)
    model, batch_of = Regression(), _batches(2)
    opt = RecordingSGD(model.parameters())
    step = _step(model, opt, grad_accum=2, grad_clip=1e-3)
    step.graphed = True  # as on CUDA
    outs = [step(batch_of) for _ in range(GRAPH_AFTER_STEPS + 2)]
    assert (
        captured == [[torch.Size([2, 8, 4]), torch.Size([2, 8])]] and step.graph is not None
    )  # captured once, at the 4th call
    ordinary, replayed = opt.seen[GRAPH_AFTER_STEPS - 1], opt.seen[GRAPH_AFTER_STEPS]
    assert torch.nn.utils.get_total_norm(replayed) == pytest.approx(1e-3, rel=1e-4)  # clipped in the body
    assert torch.nn.utils.get_total_norm(ordinary) == pytest.approx(1e-3, rel=1e-4)
    assert all(o.loss.ndim == 0 for o in outs) and len(opt.seen) == GRAPH_AFTER_STEPS + 2


def test_a_compile_failure_falls_back_to_eager_or_stops_the_run(monkeypatch, capsys):
    class Broken(Regression):
        def forward(self, x, y):
            raise torch._dynamo.exc.TorchDynamoException("the backend failed")  # any Dynamo failure

    model, batch_of = Broken(), _batches(1)
    opt = RecordingSGD(model.parameters())
    monkeypatch.setattr("trainer.compile.debug.compile_error_hint", lambda e: "hint")
    eager = Regression()
    eager.lin = model.lin  # the same parameters, a forward that works
    step = _step(model, opt, fallback=lambda m, sync: (eager, NoSync()))
    capsys.readouterr()
    out = step(batch_of)
    assert not out.skipped and len(opt.seen) == 1 and step.model is eager
    said = capsys.readouterr()
    assert said.err.startswith("warning: compile failed; compile.fallback=eager") and "hint" in said.err, said
    with pytest.raises(TrainingError, match="compile.fallback=eager"):
        _step(Broken(), RecordingSGD(model.parameters()))(batch_of)
