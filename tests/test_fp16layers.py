"""The eager decode step's layers in one C++ call (rtts/engines/fp16layers.py), where every
linear layer runs the fp16 kernel: the same math as the torch layer loop it replaces."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rtts.config import EngineConfig  # noqa: E402
from rtts.core.params import SynthParams  # noqa: E402
from rtts.engines import fp16layers  # noqa: E402
from rtts.engines.base import SynthRequest  # noqa: E402
from rtts.engines.chattts import ChatTTSEngine  # noqa: E402
from rtts.engines.gpt_loop import layer_plan  # noqa: E402

pytestmark = pytest.mark.chattts


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> ChatTTSEngine:
    # every linear layer on the fp16 kernel: the layer loop's precondition
    eng = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint, threads=2,
                                     stream_tokens=8, kernels="fp16", batch_rows=4))
    eng.load()
    return eng


def _requests(engine: ChatTTSEngine, seeds, tokens: int = 40):
    return engine._specs([SynthRequest(f"hello there, number {i}.", SynthParams(seed=i),
                                       max_new_token=tokens) for i in seeds])


def test_the_loop_computes_what_the_torch_layers_compute(engine):
    """Rows that joined at different steps (so some columns are masked for some rows): the
    hidden states and the new keys/values written match the torch loop's to float
    rounding."""
    assert fp16layers.available()  # (CI has a C++ compiler: inductor needs one)
    gpt = engine.batch(4)
    plan = layer_plan(engine.chat.gpt)
    assert plan is not None and gpt.native_rows == {1, 2, 3, 4}
    with torch.no_grad():
        gpt.add(_requests(engine, [0]))
        for _ in range(5):
            gpt.step()
        gpt.add(_requests(engine, [1, 2]))
        for _ in range(3):
            gpt.step()
        gpt._make_room(0)
        n, t = len(gpt.rows), gpt.t
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(n, 1, gpt.hidden, generator=gen)
        pos = torch.tensor([[r.next_pos] for r in gpt.rows])
        gpt.valid[:n, t] = True
        valid = gpt.valid[:n, :t + 1]
        assert not bool(valid.all())  # the later rows do not see the first row's prompt
        before = [b.clone() for b in (*gpt.keys, *gpt.values)]
        cos, sin = gpt.model.rotary_emb(h, position_ids=pos)
        want = gpt._lean_layers(h, (cos, sin), valid.view(n, 1, 1, t + 1), slice(0, n), t, 0)
        want_kv = [b.clone() for b in (*gpt.keys, *gpt.values)]
        for b, old in zip((*gpt.keys, *gpt.values), before, strict=True):
            b.copy_(old)
        got = plan.run(h.view(n, -1), plan.table(gpt.keys, gpt.values), cos.view(n, -1),
                       sin.view(n, -1), gpt.valid, t, 2, 1)
    scale = float(want.abs().max())
    assert torch.allclose(got, want.view(n, -1), atol=1e-5 * scale, rtol=0)
    for b, w in zip((*gpt.keys, *gpt.values), want_kv, strict=True):
        assert torch.allclose(b, w, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="wrong shape"):
        plan.run(h.view(n, -1)[:, :-1], plan.table(gpt.keys, gpt.values), cos.view(n, -1),
                 sin.view(n, -1), gpt.valid, t, 2, 1)


def test_eager_steps_run_the_loop_and_draw_what_the_torch_layers_draw(engine):
    """Served steps go through the loop (every row count the kernels chose fp16 for), and
    the same seeded rows draw the same codes as through the torch layers, also after the
    buffers grow (a row longer than the initial columns)."""
    runs = {}
    for native in (True, False):
        gpt = engine.batch(4)
        # 16 columns: the prompts alone need more, and the steps more again
        gpt = type(gpt)(engine.chat.gpt, gpt.num_vq, gpt.eos, 4, columns=16,
                        native_rows=gpt.native_rows if native else ())
        with torch.no_grad():
            rows = gpt.add(_requests(engine, [3, 4], tokens=12))
            for _ in range(4):
                gpt.step()
            rows += gpt.add(_requests(engine, [5], tokens=12))
            for _ in range(12):
                gpt.step()
        runs[native] = (rows, gpt.native_steps)
    (fast, steps), (slow, none) = runs[True], runs[False]
    assert none == 0 and steps >= 10 and gpt.columns > 16
    for a, b in zip(fast, slow, strict=True):
        assert a.length == b.length > 0
        assert torch.equal(a.codes[:a.length], b.codes[:b.length])
        assert torch.allclose(a.hiddens[:a.length], b.hiddens[:b.length], atol=1e-4)


def test_the_torch_layers_serve_where_the_loop_does_not_apply(engine, monkeypatch):
    """No loop for fp32 linears, bf16 keys/values, or where it cannot be built: the steps
    run the torch layers."""
    gpt = engine.batch(2)
    plain = type(gpt)(engine.chat.gpt, gpt.num_vq, gpt.eos, 2, kv_dtype=torch.bfloat16,
                      native_rows={1, 2})
    assert plain._plan is None and plain.native_rows == frozenset()
    monkeypatch.setattr(fp16layers, "available", lambda: False)
    assert fp16layers.LayerPlan.of(gpt.layers) is None
    with torch.no_grad():
        plain.add(_requests(engine, [6], tokens=4))
        plain.step()
    assert plain.native_steps == 0 and plain.rows[0].length >= 2
