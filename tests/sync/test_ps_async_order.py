"""ps-async's server with a fixed arrival order: its parameters equal a hand-computed sequence of stale updates.

The server loop (``serve_async``) runs in this process with a scripted arrival order instead
of a process group: two workers whose loss is 0.5 ||theta - t_w||^2 (gradient theta_w - t_w,
theta_w the parameters the server last sent worker w), SGD lr 0.5 (momentum 0.9 where a rule
changes momentum). The
expected parameters after every update are written out below, update by update, with each
gradient's staleness; a server that ignored one worker's gradients (or applied one twice,
or used fresh instead of stale parameters) gives other numbers.
"""
import pytest
import torch

from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import SyncStats
from ddtrain.sync.ps.protocol import FINAL, GRAD, HELLO, PARAMS, STOP, FailureNote, Plan, hyper_layout, read_hyper
from ddtrain.sync.ps.serve_async import serve_async
from ddtrain.sync.ps.server import ServerCore

LR = 0.5
TARGET = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([-1.0, 4.0])}


class RecordingCore(ServerCore):
    """A server core whose answers are recorded (parameters and version per worker) instead of sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given = {}          # worker -> (version, parameters) it last received
        self.after_update = []   # parameters after each update

    def apply_(self, *args, **kwargs):
        super().apply_(*args, **kwargs)
        self.after_update.append(self.params[0].detach().clone())

    def send(self, comm, workers, kind, label, aux=0, params=None):
        assert kind in (PARAMS, FINAL)
        sent = self.params if params is None else params
        for w in workers:
            self.given[w] = (self.version, sent[0].detach().clone())


class Scripted:
    """Messages in a fixed order: (worker, kind); a GRAD is computed on what that worker was last given."""

    anysource = True

    def __init__(self, core, script):
        self.core, self.script = core, list(script)

    def expect(self, worker):
        pass

    def release(self, worker):
        pass

    def next(self, timeout_s):
        worker, kind = self.script.pop(0)
        message = self.core.inbox[worker]
        version = 0
        if kind == GRAD:
            version, theta = self.core.given[worker]
            message.payload.copy_(theta - TARGET[worker])
            message.set_values(read_hyper(self.core.optimizer.param_groups, self.core.plan.hyper) + [1.0])
        message.set_header(kind, version)
        return worker


def serve(script, rule, momentum=0.0, optimizer_class=torch.optim.SGD, **optimizer_args):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = optimizer_class([param], lr=LR, momentum=momentum, **optimizer_args)
    plan = Plan("ps-async", [0, 1], [2], [[param]], torch.float32, torch.device("cpu"), 10.0,
                hyper=hyper_layout(optimizer.param_groups))
    core = RecordingCore(plan, optimizer, 0, Ledger(plan.operations()), SyncStats(), FailureNote("ps-async"))
    serve_async(core, bound=4, rule=rule, arrivals=Scripted(core, script))
    return core


# Both workers start, worker 0 is twice as fast as worker 1 for a while.
SCRIPT = [(0, HELLO), (1, HELLO), (0, GRAD), (0, GRAD), (1, GRAD), (0, GRAD), (1, GRAD), (0, STOP), (1, STOP)]


def test_plain_rule_applies_every_stale_gradient_as_it_arrives():
    core = serve(SCRIPT, "plain")
    t0, t1 = TARGET[0], TARGET[1]
    v0 = torch.zeros(2)                       # both workers were given version 0
    v1 = v0 - LR * (v0 - t0)                  # worker 0, computed on v0, staleness 0 -> [0.5, 1]
    v2 = v1 - LR * (v1 - t0)                  # worker 0 again, on v1 (its answer), staleness 0 -> [0.75, 1.5]
    v3 = v2 - LR * (v0 - t1)                  # worker 1, computed on v0, staleness 2 -> [0.25, 3.5]
    v4 = v3 - LR * (v2 - t0)                  # worker 0, on v2, staleness 1 -> [0.375, 3.75]
    v5 = v4 - LR * (v3 - t1)                  # worker 1, on v3, staleness 1 -> [-0.25, 4.0]
    assert torch.allclose(v5, torch.tensor([-0.25, 4.0]))
    assert len(core.after_update) == 5
    for got, want in zip(core.after_update, [v1, v2, v3, v4, v5]):
        assert torch.allclose(got, want), (got, want)
    assert core.stats.extra["staleness_histogram"] == {"0": 2, "1": 2, "2": 1}


@pytest.mark.parametrize("rule", ["staleness", "lr-staleness", "lr-staleness-momentum"])
def test_staleness_rule_divides_each_step_by_one_plus_its_staleness(rule):
    core = serve(SCRIPT, rule)                # without momentum, the momentum part changes nothing
    t0, t1 = TARGET[0], TARGET[1]
    v0 = torch.zeros(2)
    v1 = v0 - LR / 1 * (v0 - t0)              # staleness 0
    v2 = v1 - LR / 1 * (v1 - t0)              # staleness 0
    v3 = v2 - LR / 3 * (v0 - t1)              # staleness 2
    v4 = v3 - LR / 2 * (v2 - t0)              # staleness 1
    v5 = v4 - LR / 2 * (v3 - t1)              # staleness 1
    for got, want in zip(core.after_update, [v1, v2, v3, v4, v5]):
        assert torch.allclose(got, want), (got, want)
    assert core.optimizer.param_groups[0]["lr"] == LR     # the worker's value stays; each update only scales it


def test_a_tight_bound_holds_the_fast_worker_back():
    """Staleness 1: worker 0's third gradient waits until worker 1's (computed on v0) has been applied."""
    core = serve([(0, HELLO), (1, HELLO), (0, GRAD), (1, GRAD), (0, GRAD), (1, GRAD), (0, STOP), (1, STOP)], "plain")
    t0, t1 = TARGET[0], TARGET[1]
    v0 = torch.zeros(2)
    v1 = v0 - LR * (v0 - t0)                  # worker 0 on v0
    v2 = v1 - LR * (v0 - t1)                  # worker 1 on v0, staleness 1
    v3 = v2 - LR * (v1 - t0)                  # worker 0 on v1 (its answer), staleness 1
    v4 = v3 - LR * (v2 - t1)                  # worker 1 on v2, staleness 1
    for got, want in zip(core.after_update, [v1, v2, v3, v4]):
        assert torch.allclose(got, want), (got, want)


def test_lr_workers_rule_divides_each_step_by_the_number_of_workers():
    core = serve(SCRIPT, "lr-workers")
    t0, t1 = TARGET[0], TARGET[1]
    v0 = torch.zeros(2)
    v1 = v0 - LR / 2 * (v0 - t0)              # 2 workers, whatever the staleness
    v2 = v1 - LR / 2 * (v1 - t0)
    v3 = v2 - LR / 2 * (v0 - t1)
    v4 = v3 - LR / 2 * (v2 - t0)
    v5 = v4 - LR / 2 * (v3 - t1)
    for got, want in zip(core.after_update, [v1, v2, v3, v4, v5]):
        assert torch.allclose(got, want), (got, want)


def sgd_momentum(steps):
    """torch.optim.SGD's momentum by hand: buf = g on the first step, then mu * buf + g; p -= lr_k * buf."""
    p, buf, out = torch.zeros(2), None, []
    for mu, lr_k, grad_of in steps:
        g = grad_of(out)
        buf = g.clone() if buf is None else mu * buf + g
        p = p - lr_k * buf
        out.append(p)
    return out


def test_momentum_rule_keeps_total_momentum_with_the_implicit_one():
    """(1 - 0.9) = (1 - mu_e)(1 - mu_i), mu_i = m / (1 + m) for the mean staleness m so far."""
    core = serve(SCRIPT, "momentum", momentum=0.9)
    t0, t1 = TARGET[0], TARGET[1]
    v0 = torch.zeros(2)
    # staleness 0, 0, 2, 1, 1: mean so far 0, 0, 2/3, 3/4, 4/5 -> mu_i 0, 0, 2/5, 3/7, 4/9
    mu_e = [0.9, 0.9, 1 - 0.1 / (1 - 2 / 5), 1 - 0.1 / (1 - 3 / 7), 1 - 0.1 / (1 - 4 / 9)]
    grads = [lambda v: v0 - t0,               # worker 0 on v0
             lambda v: v[0] - t0,             # worker 0 on v1
             lambda v: v0 - t1,               # worker 1 on v0 (staleness 2)
             lambda v: v[1] - t0,             # worker 0 on v2
             lambda v: v[2] - t1]             # worker 1 on v3
    want = sgd_momentum([(mu, LR, g) for mu, g in zip(mu_e, grads)])
    assert len(core.after_update) == 5
    for got, w in zip(core.after_update, want):
        assert torch.allclose(got, w), (got, w)
    assert core.optimizer.param_groups[0]["momentum"] == 0.9    # the worker's value stays


def test_staleness_rule_with_momentum_subtracts_the_implicit_momentum():
    core = serve(SCRIPT, "staleness", momentum=0.9)
    t0, t1 = TARGET[0], TARGET[1]
    v0 = torch.zeros(2)
    mu = [0.9, 0.9, 0.9 - 2 / 5, 0.9 - 3 / 7, 0.9 - 4 / 9]
    lrs = [LR, LR, LR / 3, LR / 2, LR / 2]
    grads = [lambda v: v0 - t0, lambda v: v[0] - t0, lambda v: v0 - t1, lambda v: v[1] - t0, lambda v: v[2] - t1]
    want = sgd_momentum(list(zip(mu, lrs, grads)))
    for got, w in zip(core.after_update, want):
        assert torch.allclose(got, w), (got, w)


def test_dc_rule_compensates_each_stale_gradient_by_hand():
    """DC-ASGD-a: g + 2 / sqrt(ms) * g * g * (w_now - w_stale), ms = 0.95 ms + 0.05 g * g; then lr / 2 (2 workers)."""
    core = serve(SCRIPT, "dc-lr-workers")
    t0, t1 = TARGET[0], TARGET[1]
    given = [torch.zeros(2)]                  # parameters after each version: given[v]
    ms = torch.zeros(2)
    # (worker's target, version its gradient was computed on), in SCRIPT's order of application
    for target, version in [(t0, 0), (t0, 1), (t1, 0), (t0, 2), (t1, 3)]:
        now, stale = given[-1], given[version]
        g = stale - target
        ms = 0.95 * ms + 0.05 * g * g
        g = g + g * g * (now - stale) * 2.0 / (ms.sqrt() + 1e-8)
        given.append(now - LR / 2 * g)
    assert len(core.after_update) == 5
    for got, want in zip(core.after_update, given[1:]):
        assert torch.allclose(got, want), (got, want)


def test_dana_rule_gives_each_worker_its_momentum_and_look_ahead_parameters():
    """DANA-Zero (Hakimi et al. 2019) with lr / M: worker w's gradient goes into its own buffer
    m_w = mu m_w + g (torch's first step: m_w = g), theta -= lr/2 m_w, and w is sent
    theta - lr/2 * mu * (m_0 + m_1), where the pending momentum will have carried theta."""
    core = serve(SCRIPT, "dana", momentum=0.9)
    t, mu, lr = TARGET, 0.9, LR / 2
    theta = torch.zeros(2)
    given = {0: theta.clone(), 1: theta.clone()}           # HELLO: no momentum yet, the look-ahead is theta
    momenta = {}
    want = []
    for w in [0, 0, 1, 0, 1]:                               # SCRIPT's order of application
        g = given[w] - t[w]
        momenta[w] = g.clone() if w not in momenta else mu * momenta[w] + g
        theta = theta - lr * momenta[w]
        want.append(theta)
        given[w] = theta - lr * mu * sum(momenta.values())
    assert len(core.after_update) == 5
    for got, w in zip(core.after_update, want):
        assert torch.allclose(got, w), (got, w)
    assert core.stats.extra["async_rule"] == "dana"
    assert core.optimizer.param_groups[0]["lr"] == LR       # the worker's value stays; each update only scales it


@pytest.mark.parametrize("optimizer_class, args", [(torch.optim.SGD, {"nesterov": True}),
                                                   (torch.optim.SGD, {"dampening": 0.5})])
def test_dana_falls_back_to_the_staleness_rule_where_its_look_ahead_is_undefined(optimizer_class, args):
    core = serve(SCRIPT, "dana", momentum=0.9, optimizer_class=optimizer_class, **args)
    assert core.stats.extra["async_rule"] == "staleness"
