"""Load-time kernel selection for the GPT's linear layers (rtts/engines/kernels.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rtts.engines import fp16layers, fp16mm, kernels  # noqa: E402


def _decode_choice_ok(table, rows: int, offered) -> bool:
    """The decode path ``install`` should have chosen at ``rows``: the fastest offered,
    or ``fp16`` within ``FP16_LOOP_MARGIN`` of it where the fp16 layer loop builds."""
    best = min(table.ms[p][rows] for p in offered)
    path = table.chosen[rows]
    if ("fp16" in offered and fp16layers.available()
            and table.ms["fp16"][rows] <= kernels.FP16_LOOP_MARGIN * best):
        return path == "fp16"
    return bool(table.ms[path][rows] == best)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                               torch.nn.Linear(512, 256, bias=False))


@pytest.mark.parametrize("dtype", ["auto", "fp32", "bf16", "int8", "int4"])
def test_selection_measures_every_candidate_and_records_the_fastest(dtype):
    model, ref = _model(), _model()
    table = kernels.install(model, dtype, max_rows=4, repeat=1)
    candidates = tuple(p for p in kernels._CANDIDATES[dtype]
                       if p != "bf16p" or kernels.bf16p_available())
    if dtype == "auto" and not kernels.bf16p_available() and fp16mm.available():
        candidates += ("fp16",)  # the fp16 kernel, where oneDNN has no bf16
    prefill_only = tuple(p for p in kernels._PREFILL_ONLY.get(dtype, ()) if p not in candidates)
    assert set(table.ms) == {*candidates, *prefill_only}
    assert all(set(table.ms[p]) == {kernels.PREFILL_ROWS} for p in prefill_only)
    assert sorted(table.chosen) == [1, 2, 3, 4, kernels.PREFILL_ROWS]
    for rows, path in table.chosen.items():
        offered = (*candidates, *prefill_only) if rows == kernels.PREFILL_ROWS else candidates
        assert path in offered
        if rows == kernels.PREFILL_ROWS:
            assert table.ms[path][rows] == min(table.ms[p][rows] for p in offered)
        else:
            assert _decode_choice_ok(table, rows, offered), (rows, table.ms)
    assert "linear" in candidates  # plain fp32 F.linear is always a candidate, or the path
    assert table.as_dict()["chosen"] == table.chosen and "chosen" in table.summary()
    with torch.no_grad():
        for rows in (1, 3, 4, 9):  # 9 rows: more than the slots, the prefill path
            x = torch.randn(rows, 256)
            got, want = model(x), ref(x)
            cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
            assert got.shape == want.shape and got.dtype == torch.float32
            want_cos = {"fp32": 0.99999, "int4": 0.99}.get(dtype, 0.999)
            path = table.chosen.get(rows, table.chosen[kernels.PREFILL_ROWS])
            if dtype == "auto" and path not in ("bf16", "bf16p"):
                want_cos = 0.99999
            assert cos > want_cos, (dtype, rows, float(cos))


def test_forced_path_is_installed_for_every_row_count_and_frees_fp32_weights():
    model, ref = _model(), _model()
    table = kernels.install(model, "bf16", max_rows=2, force="bf16")
    assert table.ms == {} and set(table.chosen.values()) == {"bf16"}
    lin = model[0]
    assert lin.weight.numel() == 0  # the fp32 parameter is no longer kept
    assert lin.rtts_weights.bf16 is not None and lin.rtts_weights.fp32 is None
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x), atol=0.05)


needs_bf16p = pytest.mark.skipif(not kernels.bf16p_available(),
                                 reason="no oneDNN bf16 kernels on this CPU/build")


@needs_bf16p
def test_prepacked_bf16_computes_what_bf16_linear_does_eager_and_compiled():
    model, ref = _model(), _model()
    kernels.install(model, "bf16", max_rows=2, force="bf16p")
    w = model[0].rtts_weights
    assert w.bf16p is not None and w.bf16p.is_mkldnn and w.bf16 is None and w.fp32 is None
    ref.to(torch.bfloat16)
    compiled = torch.compile(model, dynamic=True)
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(rows, 256)
            want = ref(x.to(torch.bfloat16)).float()
            got = model(x)
            assert got.dtype == torch.float32
            assert torch.allclose(got, want, atol=0.02, rtol=0.02)
            # a compiled graph calls the opaque rtts::bf16p_linear op (inductor lowers
            # mkldnn's own op only for weights it packed itself)
            assert torch.allclose(compiled(x), got, atol=1e-3, rtol=1e-3)


@needs_bf16p
def test_template_keeps_bf16_parameters_that_a_compiled_step_freezes():
    """``install(template=True)`` (a compiled CPU step): where decode steps chose
    ``bf16p``, each layer keeps its bf16 weight as a parameter; compiled under
    ``TEMPLATE_OPTIONS`` the linears read them as graph constants (freezing: a later change
    to the parameter does not reach the graph) through inductor's GEMM or oneDNN, whichever
    it timed faster, and compute what the eager bf16p path does."""
    model, ref = _model(), _model()
    table = kernels.install(model, "bf16", max_rows=2, force="bf16p", template=True)
    assert table.template and table.as_dict()["template"]
    for lin, want in ((model[0], ref[0]), (model[2], ref[2])):
        w = lin.rtts_weights
        assert isinstance(w.bf16c, torch.nn.Parameter) and not w.bf16c.requires_grad
        assert torch.equal(w.bf16c, want.weight.detach().to(torch.bfloat16))
    # not for other paths, nor without a compiled step
    other = kernels.install(_model(), "int4", max_rows=2, force="int4", template=True)
    plain = kernels.install(_model(), "bf16", max_rows=2, force="bf16p")
    assert not other.template and not plain.template
    compiled = torch.compile(model)
    x = torch.randn(1, 256)
    with torch.no_grad(), kernels.inductor_options(kernels.TEMPLATE_OPTIONS):
        got = compiled(x)
        eager = model(x)
        assert torch.allclose(got, eager, atol=2e-2, rtol=2e-2), float((got - eager).abs().max())
        model[0].rtts_weights.bf16c.zero_()
        assert torch.equal(compiled(x), got)  # frozen: the graph's own copy


@pytest.mark.parametrize("path,native_dtype", [
    ("linear", "float32"), ("transposed", "float32"), ("bf16", "bfloat16"),
    ("int8", "float32"), ("int8bf", "bfloat16"), ("int4", "bfloat16")])
def test_native_output_is_the_kernels_own_dtype_and_the_same_values(path, native_dtype):
    """``rtts_native`` (what the GPT layer loop calls) skips the cast to fp32 where the
    kernel gives bf16, and takes bf16 input (the MLP's gate/up into down_proj)."""
    model = _model()
    kernels.install(model, "int4" if path == "int4" else "int8", max_rows=2, force=path)
    lin = model[2]  # no bias: bias goes on in fp32, so a biased layer's output is fp32
    with torch.no_grad():
        for rows in (1, 2, 9):
            x = torch.randn(rows, 512)
            fp32, native = lin(x), lin.rtts_native(x)
            assert fp32.dtype == torch.float32
            assert native.dtype == getattr(torch, native_dtype)
            assert torch.equal(native.float(), fp32)
            # bf16 input: what the fp32 paths cast, and the bf16 paths take as it is
            xb = x.to(torch.bfloat16)
            assert torch.equal(lin.rtts_native(xb).float(), lin(xb.float()))
        biased = model[0]
        assert biased.rtts_native(torch.randn(2, 256)).dtype == torch.float32


def test_uniform_choice_keeps_one_path_from_two_rows_up(monkeypatch):
    # int8bf fastest at 2 rows (2x), linear at 3 and 4 (2.5x): uniform keeps the path whose
    # worst slowdown against the fastest is least
    fake = {"int8bf": {1: 1.0, 2: 1.0, 3: 5.0, 4: 5.0, kernels.PREFILL_ROWS: 9.0},
            "linear": {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0, kernels.PREFILL_ROWS: 3.0}}
    monkeypatch.setitem(kernels._CANDIDATES, "int8", ("int8bf", "linear"))

    def timed(weights, fn, rows, shapes, repeat):
        return fake[fn.__name__][rows]

    monkeypatch.setattr(kernels, "_time_path", timed)
    free = kernels.install(_model(), "int8", max_rows=4)
    assert [free.chosen[r] for r in (1, 2, 3, 4)] == ["int8bf", "int8bf", "linear", "linear"]
    one = kernels.install(_model(), "int8", max_rows=4, uniform=True)
    assert [one.chosen[r] for r in (1, 2, 3, 4)] == ["int8bf", "linear", "linear", "linear"]
    assert one.chosen[kernels.PREFILL_ROWS] == "linear"


def test_batched_input_shapes_are_kept():
    model = _model()
    kernels.install(model, "fp32", max_rows=4, repeat=1)
    with torch.no_grad():
        assert model(torch.randn(2, 1, 256)).shape == (2, 1, 256)  # a decode step's shape
        assert model(torch.randn(1, 7, 256)).shape == (1, 7, 256)  # a prefill's


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError):
        kernels.install(_model(), "fp8")


def test_table_counts_the_weight_bytes_each_path_reads():
    table = kernels.install(_model(), "int4", max_rows=1, repeat=1)
    n = 256 * 512 * 2  # two layers of 256 x 512 weights
    assert table.bytes["linear"] == 4 * n
    assert table.bytes["int8bf"] == n + 2 * (512 + 256)  # int8 weights, bf16 scales
    assert table.bytes["int4"] == n // 2 + 4 * (512 * 256 // 32 + 256 * 512 // 32)
    if kernels.bf16p_available():
        assert table.bytes["bf16p"] == 2 * n


def test_linear_ms_scales_the_timed_layers_to_all_of_them(monkeypatch):
    """The table times a prefix of the layers (TIMED_BYTES); linear_ms is the chosen path's
    ms per decode row count scaled up by the share of weight bytes timed."""
    monkeypatch.setattr(kernels, "TIMED_BYTES", 1)  # time only the first layer
    table = kernels.install(_model(), "fp32", max_rows=3, repeat=1)
    assert table.timed_share == pytest.approx(0.5)  # two layers of 256 x 512 weights
    lin = table.linear_ms()
    assert set(lin) == {1, 2, 3}
    for rows, ms in lin.items():
        assert ms == pytest.approx(2 * table.ms[table.chosen[rows]][rows])
    monkeypatch.undo()  # the default bound covers both small layers
    whole = kernels.install(_model(), "fp32", max_rows=2, repeat=1)
    assert whole.timed_share == 1.0


def test_int4_refuses_shapes_its_kernel_cannot_pack():
    with pytest.raises(ValueError, match="int4"):
        kernels.install(torch.nn.Sequential(torch.nn.Linear(100, 64)), "int4", force="int4")


def test_thread_tuner_keeps_the_faster_count_and_probes_cheaply():
    from rtts.engines.gpt_loop import ThreadTuner

    calls = []
    tuner = ThreadTuner([2, 1], calls.append, period=10, probe=3)
    assert tuner.current == 2 and calls == [2]
    # quiet machine: 2 threads 20 ms, 1 thread 30 ms a step
    cost = {2: 0.020, 1: 0.030}
    for _ in range(200):
        tuner.observe(4, cost[tuner.current])
    assert tuner.best(4) == 2 and tuner.current == 2
    # each probe of 1 thread lost at its first step, so probes got rarer
    assert tuner.period > 10 and calls.count(1) < 12
    # a neighbour arrives: 2 threads collapse to 500 ms, 1 thread keeps 60 ms
    cost = {2: 0.500, 1: 0.060}
    spent = 0.0
    for _ in range(400):
        spent += cost[tuner.current]
        tuner.observe(4, cost[tuner.current])
    assert tuner.current == 1 and tuner.best(4) == 1
    # the collapsing count ran only a few steps (its average had to fall behind first)
    assert spent < 400 * 0.060 * 1.6
    # the neighbour leaves: probing 2 threads again wins it back
    cost = {2: 0.020, 1: 0.030}
    for _ in range(3000):
        tuner.observe(4, cost[tuner.current])
    assert tuner.current == 2
    # row counts are learned separately
    tuner.observe(1, 0.010)
    assert (2, 1) in tuner.ms


def test_realtime_capacity_counts_rows_whose_steps_and_decoding_fit_a_second():
    from rtts.engines.chattts import TOKENS_PER_SECOND, realtime_capacity

    budget_ms = 1000 / TOKENS_PER_SECOND  # 21.3 ms a step with nothing else to do
    steps = {1: 12.0, 2: 14.0, 4: 18.0, 8: 40.0}
    # decoding 0.05 s per audio second: 4 rows need 46.875 * 18 ms + 4 * 0.05 s = 1.04 s
    assert realtime_capacity(steps, 0.05, slots=8) == 2
    assert realtime_capacity(steps, 0.0, slots=8) == 4  # 18 ms < 21.3 ms, 40 ms is not
    assert realtime_capacity(steps, 0.0, slots=2) == 2  # never more than the slots
    assert realtime_capacity({1: budget_ms * 1.01}, 0.0, slots=8) == 0
    assert realtime_capacity({}, 0.0, slots=8) == 0  # nothing measured yet


def test_prefill_per_audio_second_is_averaged_over_windows():
    """The prefill of joining segments, per second of audio, closes a window once it holds
    PREFILL_WINDOW_S of audio; /v1/info's capacity adds it to the decoding cost."""
    from rtts.config import EngineConfig
    from rtts.engines.chattts import PREFILL_WINDOW_S, ChatTTSEngine, _prefill_update

    eng = ChatTTSEngine(EngineConfig())
    eng._prefill_window[0] += 0.4  # seconds of prefill
    _prefill_update(eng, 1.0)  # window not full yet
    assert eng.prefill_s_per_audio_s == 0
    _prefill_update(eng, PREFILL_WINDOW_S)
    first = 0.4 / (1.0 + PREFILL_WINDOW_S)
    assert eng.prefill_s_per_audio_s == pytest.approx(first)
    assert eng._prefill_window == [0.0, 0.0]
    _prefill_update(eng, PREFILL_WINDOW_S)  # a window with no segment joining
    assert eng.prefill_s_per_audio_s == pytest.approx(0.7 * first)


def test_fused_projections_compute_what_the_separate_ones_did():
    """gpt_loop.fuse_projections: one q/k/v and one gate/up matrix per Llama layer; the
    old projections stay callable (slices of the fused output) and the layer's own forward
    computes what it computed before."""
    transformers = pytest.importorskip("transformers")
    from rtts.engines.gpt_loop import fuse_projections

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4,
                                   vocab_size=32)
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = model(inputs_embeds=x).last_hidden_state
        parts = [model.layers[0].self_attn.k_proj(x), model.layers[1].mlp.up_proj(x)]
        assert fuse_projections(model) == 2
        assert fuse_projections(model) == 0  # already fused
        layer = model.layers[0]
        assert layer.self_attn.rtts_qkv.out_features == 3 * 64
        assert layer.mlp.rtts_gate_up.out_features == 2 * 128
        linears = kernels.linears(model)
        assert len(linears) == 2 * 4 and layer.self_attn.q_proj not in linears
        assert torch.allclose(model.layers[0].self_attn.k_proj(x), parts[0], atol=1e-6)
        assert torch.allclose(model.layers[1].mlp.up_proj(x), parts[1], atol=1e-6)
        got = model(inputs_embeds=x).last_hidden_state
    assert torch.allclose(got, want, atol=1e-5)


def test_int8dyn_compiles_into_one_graph_as_an_opaque_op():
    """``int8dyn`` (fbgemm's dynamic int8 linear, a module with TorchScript packed weights)
    inside torch.compile: called as ``rtts::int8dyn_linear``, so the graph has no break
    (fullgraph) and computes what the eager path computes."""
    model = _model()
    table = kernels.install(model, "int8", max_rows=4, force="int8dyn")
    assert set(table.chosen.values()) == {"int8dyn"}
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for rows in (2, 3):
            x = torch.randn(rows, 256)
            assert torch.allclose(compiled(x), model(x), atol=1e-5)


def test_decode_attention_computes_what_masked_sdpa_computes():
    """``decode_attention`` (one new token, written as reductions for a compiled step)
    against SDPA with the same slot mask, over fp32 and bf16 keys/values, eager and
    compiled; masked columns (other rows' slots) do not count."""
    torch.manual_seed(0)
    rows, heads, columns, d = 3, 4, 37, 16
    q = torch.randn(rows, heads, 1, d)
    k, v = torch.randn(rows, heads, columns, d), torch.randn(rows, heads, columns, d)
    mask = torch.rand(rows, 1, 1, columns) > 0.3
    mask[..., -1] = True  # every row sees its own new column
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            scale=0.25)
    compiled = torch.compile(kernels.decode_attention, fullgraph=True, dynamic=True)
    for fn in (kernels.decode_attention, compiled):
        assert torch.allclose(fn(q, k, v, mask, 0.25), want, atol=1e-5)
        got = fn(q, k.bfloat16(), v.bfloat16(), mask, 0.25)  # read as bf16, summed in fp32
        assert got.dtype == torch.float32
        assert torch.allclose(got, want, atol=3e-2)
    mask[0, ..., 0] = False  # a column row 0 does not see: changing it changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 0] += 100.0
    v2[0, :, 0] -= 100.0
    assert torch.allclose(kernels.decode_attention(q, k2, v2, mask, 0.25),
                          kernels.decode_attention(q, k, v, mask, 0.25), atol=1e-6)


def test_int8_keys_and_values_attend_as_their_dequantized_values_do():
    """``quantize_kv``: int8 with one scale per vector, within half a step of each value;
    ``decode_attention_int8`` computes masked SDPA over the dequantized keys/values (eager
    and compiled), and stays near the fp32 result."""
    torch.manual_seed(0)
    rows, heads, columns, d = 3, 4, 37, 16
    q = torch.randn(rows, heads, 1, d)
    k, v = torch.randn(rows, heads, columns, d), torch.randn(rows, heads, columns, d)
    k[0, 0, 0] = 0.0  # an all-zero vector: a tiny scale, no division by zero
    mask = torch.rand(rows, 1, 1, columns) > 0.3
    mask[..., -1] = True
    (kq, ks), (vq, vs) = kernels.quantize_kv(k), kernels.quantize_kv(v)
    assert kq.dtype == torch.int8 and ks.shape == (rows, heads, columns)
    assert int(kq.abs().max()) <= 127 and bool(torch.isfinite(ks).all())
    assert bool(((kq.float() * ks.unsqueeze(-1) - k).abs() <= ks.unsqueeze(-1) / 2 + 1e-6).all())
    assert int(kq[0, 0, 0].abs().max()) == 0
    deq = torch.nn.functional.scaled_dot_product_attention(
        q, kq.float() * ks.unsqueeze(-1), vq.float() * vs.unsqueeze(-1), attn_mask=mask,
        scale=0.25)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             scale=0.25)
    compiled = torch.compile(kernels.decode_attention_int8, fullgraph=True, dynamic=True)
    for fn in (kernels.decode_attention_int8, compiled):
        got = fn(q, kq, ks, vq, vs, mask, 0.25)
        assert got.dtype == torch.float32 and got.shape == (rows, heads, 1, d)
        assert torch.allclose(got, deq, atol=1e-5)
        assert float((got - exact).norm() / exact.norm()) < 0.03


def test_kv_precision_can_be_forced_untimed():
    """``--kv-dtype`` other than auto is taken as it is (no timing), for any dtype;
    anything else is refused."""
    for kv in ("fp32", "bf16", "int8"):
        assert kernels.choose_kv_dtype("int4", 2, 2, 16, 2, compiled=True, force=kv) == (kv, {})
    assert kernels.choose_kv_dtype("fp32", 2, 2, 16, 2, force="int8") == ("int8", {})
    assert kernels.sdpa_dtype("int8", {}) == "fp32"  # prefill reads them dequantized
    with pytest.raises(ValueError, match="kv dtype"):
        kernels.choose_kv_dtype("int4", 2, 2, 16, 2, force="fp16")


def test_kv_precision_for_a_compiled_step_times_both_ways_of_reading():
    """With a compiled decode step the keys/values' precision is decided by the compiled
    reductions' times; SDPA's are kept, and where bf16 SDPA is the slower one, prefill
    (SDPA) reads the bf16 buffer upcast to fp32 (``sdpa_dtype``)."""
    kv, us = kernels.choose_kv_dtype("int4", layers=2, heads=2, head_dim=16, rows=2,
                                      columns=32, repeat=1, compiled=True)
    # int8 is a candidate of the lossy dtypes' compiled step (int4 here), not of auto's
    assert set(us) == {"fp32", "bf16", "int8", "sdpa_fp32", "sdpa_bf16"}
    assert kv == min(("fp32", "bf16", "int8"), key=lambda k: us[k])
    assert kernels.sdpa_dtype(kv, us) in {"fp32", kv}
    assert kernels.sdpa_dtype("bf16", {"sdpa_fp32": 1.0, "sdpa_bf16": 2.0}) == "fp32"
    assert kernels.sdpa_dtype("bf16", {"sdpa_fp32": 2.0, "sdpa_bf16": 1.0}) == "bf16"
    assert kernels.sdpa_dtype("bf16", {"fp32": 2.0, "bf16": 1.0}) == "bf16"  # eager: timed SDPA
    assert kernels.sdpa_dtype("fp32", {}) == "fp32"
    assert kernels.choose_kv_dtype("fp32", 2, 2, 16, 2, compiled=True) == ("fp32", {})
    _kv, us = kernels.choose_kv_dtype("auto", layers=2, heads=2, head_dim=16, rows=2,
                                       columns=32, repeat=1, compiled=True)
    assert "int8" not in us


def test_eager_attention_runs_on_the_thread_count_that_measured_faster():
    """Without a compiled step, SDPA is timed on one thread and on the step's threads for
    each keys/values precision; the fastest of the four picks the precision, and
    solo_attention says whether that precision's attention runs on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kv, us = kernels.choose_kv_dtype("int4", layers=2, heads=2, head_dim=16, rows=2,
                                          columns=32, repeat=1)
        assert torch.get_num_threads() == 2  # restored after the 1-thread timings
    finally:
        torch.set_num_threads(threads)
    assert set(us) == {"fp32", "bf16", "fp32_threads", "bf16_threads"}
    assert min(us[kv], us[f"{kv}_threads"]) == min(us.values())
    assert kernels.solo_attention(kv, us) == (us[kv] <= us[f"{kv}_threads"])
    assert kernels.solo_attention("fp32", {"fp32": 1.0, "fp32_threads": 2.0})
    assert not kernels.solo_attention("bf16", {"bf16": 2.0, "bf16_threads": 1.0})
    assert kernels.solo_attention("fp32", {})  # untimed (fp32, a GPU): one thread, as before
    assert kernels.solo_attention("bf16", {"bf16": 1.0, "fp32": 2.0})  # one thread timed


def test_code_heads_follow_the_precision_of_the_step():
    """install_heads: where the decode step at a row count is not fp32, the code heads are
    timed on fp32 F.linear and the transposed product and the faster kept (fp32 logits
    either way: bf16 ones would tie and send top-P to its torch.sort fallback); where the
    step is fp32 (--dtype fp32, forced fp32 kernels) they stay F.linear, untimed."""
    torch.manual_seed(0)
    weight = torch.randn(4 * 626, 768) * 0.02
    exact = kernels.KernelTable("fp32", {1: "linear", 2: "transposed",
                                         kernels.PREFILL_ROWS: "linear"})
    assert kernels.install_heads(weight, exact, repeat=1) is None
    assert exact.heads == {}
    lossy = kernels.KernelTable("int4", {1: "int4", 2: "linear", 3: "int4", 4: "bf16p",
                                         kernels.PREFILL_ROWS: "int8dyn"})
    fn = kernels.install_heads(weight, lossy, repeat=1)
    assert set(lossy.heads) == {1, 3, 4}  # fp32 at 2 rows: not offered; prefill: no step
    assert set(lossy.heads_ms) == set(kernels.HEAD_PATHS)
    for rows, path in lossy.heads.items():
        assert lossy.heads_ms[path][rows] == min(v[rows] for v in lossy.heads_ms.values())
    assert lossy.as_dict()["heads"] == lossy.heads
    assert (fn is None) == (set(lossy.heads.values()) == {"linear"})
    if fn is None:
        return
    with torch.no_grad():
        for rows in (1, 2, 3, 4, 5):
            x = torch.randn(rows, 768)
            got, want = fn(x), torch.nn.functional.linear(x, weight)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-5)
            if rows in (2, 5) or lossy.heads.get(rows) == "linear":
                assert torch.equal(got, want)  # F.linear where the step is fp32 or untimed


def test_int8dyn_registry_lets_the_packed_weights_go_with_their_model():
    """``rtts::int8dyn_linear`` finds fbgemm's linears through a registry of weak
    references: a model's packed int8 weights are freed with the model, not kept for the
    life of the process (tests and benches install many models in one process)."""
    import gc

    model = _model()
    kernels.install(model, "int8", max_rows=1, force="int8dyn")
    w = model[0].rtts_weights
    index = w.qdyn_index
    assert index >= 0 and kernels._INT8DYN[index]() is w.qdyn
    x = torch.randn(3, 256)
    assert torch.equal(kernels._int8dyn_mm(x, index, 512), w.qdyn(x))
    del model, w
    gc.collect()
    assert kernels._INT8DYN[index]() is None
    with pytest.raises(RuntimeError, match="released"):
        kernels._int8dyn_mm(x, index, 512)


def test_fp16_weights_compute_in_fp32_eager_and_compiled():
    """``fp16``: fp16 weights, fp32 sums. Compiled at 1 row, the linear is a product and
    a sum that inductor fuses with the upcast (``kernels.fp16_linear``); compiled at 2+
    rows and eager, rtts's kernel (``fp16mm``, ``rtts::fp16_linear`` in the graph); without
    the kernel, eager is torch's fp16 GEMV at 1 row, else an fp32 product. All compute
    what the fp32 layers do, to fp16's rounding of the weights, at any activation size."""
    model, ref = _model(), _model()
    table = kernels.install(model, "auto", max_rows=2, force="fp16")
    assert set(table.chosen.values()) == {"fp16"}
    w = model[0].rtts_weights
    assert w.fp16.dtype == torch.float16 and w.fp32 is None and w.bf16 is None
    assert table.bytes["fp16"] == 2 * (256 * 512 + 512 * 256)
    compiled = torch.compile(model, dynamic=True)
    plain = _model()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp16mm, "available", lambda: False)  # torch's own forms
        kernels.install(plain, "auto", max_rows=2, force="fp16")
    with torch.no_grad():
        for rows, scale in ((1, 1.0), (2, 1.0), (3, 1.0), (1, 1e5), (5, 1e5)):
            x = torch.randn(rows, 256) * scale
            want = ref(x)
            for got in (model(x), compiled(x), plain(x)):
                assert got.dtype == torch.float32 and torch.isfinite(got).all()
                cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
                assert cos > 0.99999, (rows, scale, float(cos))
                assert torch.allclose(got, want, rtol=1e-2, atol=1e-3 * scale)


def test_fp16_kernel_matches_fp32_at_any_row_count_and_length():
    """``fp16mm.mm``: fp32 rows times fp16 weights, summed in fp32, at the row counts of
    its blocks of four and past them, with K not a multiple of its vector width (the
    scalar tail); bad inputs are refused with a clear error."""
    torch.manual_seed(0)
    for rows, n, k in ((1, 64, 768), (1, 5, 56), (2, 3, 40), (3, 6, 50), (4, 17, 33),
                       (5, 96, 3072), (9, 8, 7)):
        x = torch.randn(rows, k)
        w = torch.randn(n, k).half()
        got = fp16mm.mm(x, w)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert torch.allclose(got, x.double().mm(w.double().t()).float(), rtol=1e-4,
                              atol=1e-4 * k ** 0.5), (rows, n, k)
    assert torch.equal(fp16mm.mm(x[:, ::1].t().contiguous().t(), w), fp16mm.mm(x, w))
    for bad in ((x.double(), w), (x, w.float()), (x[:, :3], w), (x[0], w)):
        with pytest.raises(ValueError, match="fp16mm.mm needs"):
            fp16mm.mm(*bad)


def test_fp16_is_a_candidate_of_auto_only_where_onednn_has_no_bf16(monkeypatch):
    """``auto`` on a CPU without oneDNN bf16 also times ``fp16``: with a compiled CPU step
    (``template``) compiled as the step runs it, at 1 row, and at 2+ where rtts's kernel
    builds (``fp16mm``); eager, as a plain candidate where the kernel builds. Never for
    prefill, the other dtypes, or where a weight is beyond fp16's range. Where a decode
    row count chose it, the compiled step gets ``FP16_OPTIONS``."""
    monkeypatch.setattr(kernels, "bf16p_available", lambda: False)
    assert fp16mm.available()  # (CI has a C++ compiler: inductor needs one)
    table = kernels.install(_model(), "auto", max_rows=3, repeat=1, template=True,
                            uniform=True)
    assert set(table.ms["fp16"]) == {1, 2, 3}
    assert table.chosen[kernels.PREFILL_ROWS] != "fp16"
    assert table.chosen[2] == table.chosen[3]  # one path for 2+ rows (uniform)
    eager = kernels.install(_model(), "auto", max_rows=2, repeat=1)
    assert set(eager.ms["fp16"]) == {1, 2, kernels.PREFILL_ROWS}
    assert table.ms[table.chosen[1]][1] == min(m[1] for m in table.ms.values() if 1 in m)
    assert _decode_choice_ok(eager, 1, tuple(eager.ms))
    assert _decode_choice_ok(eager, 2, tuple(eager.ms))
    monkeypatch.setattr(fp16mm, "available", lambda: False)  # no compiler here
    table = kernels.install(_model(), "auto", max_rows=2, repeat=1, template=True)
    assert set(table.ms["fp16"]) == {1}
    assert "fp16" not in (table.chosen[2], table.chosen[kernels.PREFILL_ROWS])
    assert "fp16" not in kernels.install(_model(), "auto", max_rows=2, repeat=1).ms
    table.chosen[1] = "fp16"
    assert kernels.compile_options(table) == kernels.FP16_OPTIONS
    table.chosen[1] = table.chosen[2]
    assert kernels.compile_options(table) is None and kernels.compile_options(None) is None
    table.template = True
    assert kernels.compile_options(table) == kernels.TEMPLATE_OPTIONS
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "bf16p_available", lambda: False)
    assert "fp16" not in kernels.install(_model(), "fp32", max_rows=2, repeat=1,
                                         template=True).ms
    big = _model()
    with torch.no_grad():
        big[0].weight[0, 0] = 7e4
    assert "fp16" not in kernels.install(big, "auto", max_rows=2, repeat=1, template=True).ms


def test_auto_takes_fp16_within_the_layer_loops_margin_where_it_builds(monkeypatch):
    """Eager, where the fp16 layer loop builds (``fp16layers``), ``auto`` takes ``fp16`` at
    a decode row count unless another path's linears alone are more than
    ``FP16_LOOP_MARGIN`` faster (the loop saves the step's small torch ops); prefill
    keeps the fastest; without the loop, the fastest everywhere."""
    margin = kernels.FP16_LOOP_MARGIN
    fake = {"fp16": {1: 1.0, 2: 1.0, 3: 1.0, kernels.PREFILL_ROWS: 2.0},
            "linear": {1: 0.9 / margin, 2: 1.1 / margin, 3: 1.5, kernels.PREFILL_ROWS: 1.0}}
    monkeypatch.setattr(kernels, "bf16p_available", lambda: False)
    monkeypatch.setitem(kernels._CANDIDATES, "auto", ("linear",))
    monkeypatch.setattr(kernels, "_time_path",
                        lambda weights, fn, rows, shapes, repeat: fake[fn.__name__][rows])
    assert fp16layers.available()  # (CI has a C++ compiler: inductor needs one)
    table = kernels.install(_model(), "auto", max_rows=3)
    assert [table.chosen[r] for r in (1, 2, 3)] == ["linear", "fp16", "fp16"]
    assert table.chosen[kernels.PREFILL_ROWS] == "linear"
    monkeypatch.setattr(fp16layers, "available", lambda: False)
    table = kernels.install(_model(), "auto", max_rows=3)
    assert [table.chosen[r] for r in (1, 2, 3)] == ["linear", "linear", "fp16"]
