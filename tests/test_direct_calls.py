"""``piecewise_backend.direct``: a signature seen once skips Dynamo afterwards, and goes back through
Dynamo when a module's parameters move or when skipping it would not give what Dynamo gives (CPU,
graphs emulated)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import piecewise_backend
from toys.engine import ATTENTION, TINY, Engine, EngineModel, seeded_trace

pytestmark = pytest.mark.usefixtures("emulated_graphs")
EAGER_PIECES = {"compiler": "eager"}  # the traced code, captured the same way: no Inductor compile (fast)


class Mlp(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _direct(model, options=EAGER_PIECES):
    torch._dynamo.reset()
    return piecewise_backend.direct(torch.compile(model, backend="piecewise", options=options))


def _mlp_through_direct():
    """A seeded MLP, its direct() wrapper and an input of 4 rows."""
    torch.manual_seed(0)
    model = Mlp().eval()
    return model, _direct(model), torch.randn(4, 16)


def test_the_engine_serves_the_eager_engines_tokens_with_dynamo_skipped_after_each_first_signature():
    torch.manual_seed(0)
    model = EngineModel(dataclasses.replace(TINY, layers=2)).init_weights_().eval()

    def serve(forward):
        engine = Engine(model, forward, max_num_tokens=32, max_num_seqs=4, num_blocks=64)
        return [r.output for r in engine.run(seeded_trace(10, seed=2, vocab=model.cfg.vocab))]

    expected = serve(None)
    forward = _direct(model, {"extra_splitting_ops": [ATTENTION], "row_independent_ops": [ATTENTION]})
    assert serve(forward) == expected
    assert forward.skipped_dynamo > forward.through_dynamo > 0, (forward.skipped_dynamo, forward.through_dynamo)
    assert forward.refusals() == {}
    graphs = piecewise_backend.compiled_graphs()
    assert sum(g.stats.full_replays for g in graphs) > 0  # decode steps replayed whole, reached directly


def test_a_parameter_assigned_anew_sends_the_next_call_through_dynamo():
    model, forward, x = _mlp_through_direct()
    with torch.inference_mode():
        forward(x)
        torch.testing.assert_close(forward(x), model(x))
        assert (forward.through_dynamo, forward.skipped_dynamo) == (1, 1)
        model.up.weight = nn.Parameter(torch.randn_like(model.up.weight))  # a new tensor, not an in-place copy
        torch.testing.assert_close(forward(x), model(x))
        assert forward.through_dynamo == 2
        Mlp().up.weight = nn.Parameter(torch.zeros(64, 16))  # another model's: nothing of ours moved
        forward(x)
        assert forward.through_dynamo == 2
        with torch.no_grad():
            model.down.weight.mul_(2)  # in place: the graph reads it where it is
        torch.testing.assert_close(forward(x), model(x))
        assert forward.skipped_dynamo == 3


def test_a_new_shape_or_grad_mode_is_a_new_signature():
    torch.manual_seed(0)
    model = Mlp().eval()
    forward = _direct(model)
    with torch.inference_mode():
        for rows in (4, 4, 6, 6, 4):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(forward(x), model(x))
    assert (forward.through_dynamo, forward.skipped_dynamo) == (2, 3)
    with torch.no_grad():
        x = torch.randn(4, 16)
        torch.testing.assert_close(forward(x), model(x))
    assert forward.through_dynamo == 3


class WithBreak(Mlp):
    def forward(self, x):
        h = self.up(x)
        torch._dynamo.graph_break()
        return self.down(h)


class ReturnsADict(Mlp):
    def forward(self, x):
        return {"out": super().forward(x)}


@pytest.mark.parametrize(
    "model_cls,reason",
    [(WithBreak, "ran 2 compiled graphs (a graph break"), (ReturnsADict, "result is not the graph's output")],
)
def test_calls_dynamo_must_finish_stay_on_its_path_and_say_why(model_cls, reason):
    torch.manual_seed(0)
    model = model_cls().eval()
    forward = _direct(model)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        for _ in range(3):
            got = forward(x)
            got = got["out"] if isinstance(got, dict) else got
            expected = model(x)
            torch.testing.assert_close(got, expected["out"] if isinstance(expected, dict) else expected)
    assert (forward.through_dynamo, forward.skipped_dynamo) == (3, 0)
    (why,) = forward.refusals().values()
    assert reason in why, why


def test_direct_refuses_what_is_not_callable_and_wraps_once():
    with pytest.raises(TypeError, match="expected what torch.compile returned"):
        piecewise_backend.direct(3)
    forward = _direct(Mlp())
    assert piecewise_backend.direct(forward) is forward
    assert isinstance(forward.up, nn.Linear)  # the module's attributes, through the wrapper


def test_a_compiled_method_with_keyword_arguments_is_served_and_any_registration_counts():
    """``torch.compile(model.forward)`` names no module to watch: a registration on any module sends
    its signatures back through Dynamo (conservative: the compiled code may read any module)."""
    torch.manual_seed(0)
    model = Mlp().eval()
    torch._dynamo.reset()
    forward = piecewise_backend.direct(torch.compile(model.forward, backend="piecewise", options=EAGER_PIECES))
    x = torch.randn(4, 16)
    with torch.inference_mode():
        for _ in range(2):
            torch.testing.assert_close(forward(x=x), model(x))
        assert (forward.through_dynamo, forward.skipped_dynamo) == (1, 1)
        Mlp()  # registrations elsewhere
        torch.testing.assert_close(forward(x=x), model(x))
        assert forward.through_dynamo == 2


def test_threads_calling_at_once_each_get_their_own_rows():
    import threading

    torch.manual_seed(0)
    model = Mlp().eval()
    forward = _direct(model)
    inputs = {rows: torch.randn(rows, 16) for rows in (2, 3, 5)}
    with torch.inference_mode():
        expected = {rows: model(x) for rows, x in inputs.items()}
    failures = []

    def serve(rows):
        with torch.inference_mode():
            for _ in range(20):
                got = forward(inputs[rows])
                if not torch.allclose(got, expected[rows], atol=1e-5):
                    failures.append(rows)

    threads = [threading.Thread(target=serve, args=(rows,)) for rows in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and forward.skipped_dynamo > 0, (failures, forward.skipped_dynamo)


def test_a_copy_records_afresh():
    import copy

    model, forward, x = _mlp_through_direct()
    with torch.inference_mode():
        forward(x)
        twin = copy.copy(forward)
        assert twin.compiled is forward.compiled and twin.through_dynamo == 0
        model.up.weight = nn.Parameter(torch.randn_like(model.up.weight))
        torch.testing.assert_close(twin(x), model(x))
        torch.testing.assert_close(twin(x), model(x))
        assert (twin.through_dynamo, twin.skipped_dynamo) == (1, 1)
