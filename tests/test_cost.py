"""The analytic cost model against XLA's own counts, growth exponents, and the seeds' claim.

* matmul FLOPs: the model equals the ``dot`` FLOPs of XLA's optimised HLO *exactly* (a
  multiply-add is 2; contractions with no free dimension are lowered to multiply + reduce and
  counted as elementwise in both);
* transcendentals: the model equals ``cost_analysis()["transcendentals"]`` exactly;
* elementwise work: XLA's remaining count is at least 0 and at most ``4 x`` the model's count
  from attnref's source: XLA fuses cheap producers into every consuming fusion and counts each
  copy, and no intermediate in attnref's kernels feeds more than 4 consumers (the masked
  softmax's ``allowed``). The measured ratio is <= 2.5 on the problems below.
* scan-based forms: XLA counts a ``while`` body once; :meth:`Cost.as_counted_by_xla` does too.
* temporary memory: between the model's largest intermediate and its workspace bound (every
  intermediate at once plus one copy of the inputs).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnref
from attnref.costs import Dims, cost, hlo_dot_flops, xla_counts

SHAPES = [(2, 16, 2, 16, 4, 6), (1, 24, 3, 12, 8, 4)]
MAPS = ("elu_plus_one", "favor_plus", "taylor2")
DUPLICATION = 4


def _run(f, dims: Dims, fm_name: str = "elu_plus_one"):
    p = attnref.init_params(
        0, d_model=dims.d_model, num_heads=dims.heads, d_k=dims.d_k, d_v=dims.d_v, bias=dims.bias
    )
    x = np.zeros((dims.batch, dims.t_q, dims.d_model), np.float32)
    # What the family requires (the linear family's feature map; FAVOR+ gets 2 d_k features,
    # which is dims.features here), then the options the entry takes: a full mask and bias where
    # it takes them (so all the model's mask and bias work is there), else the causal flag.
    setting = SimpleNamespace(t_q=dims.t_q, t_k=dims.t_k, d_k=dims.d_k, seed=0, feature_map=fm_name)
    kw = f.family.required_kwargs(setting)
    takes = inspect.signature(f.apply).parameters
    if "bias" in takes:
        full = (dims.batch, dims.t_q, dims.t_k)
        kw.update(mask=np.ones(full, bool), bias=np.zeros(full, np.float32))
    if "causal" in takes:
        kw["causal"] = dims.causal
    if "chunk_size" in f.static_argnames:
        kw["chunk_size"] = dims.chunk
    return xla_counts(f.jit(), p, x, **kw)


# Softmax forms: each shape once (biases off on the first, on on the second). Linear forms:
# every feature map on one shape with biases, and the default map on the other without.
CASES = (
    [(f.id, SHAPES[0], False, "-") for f in attnref.formulations("softmax")]
    + [(f.id, SHAPES[1], True, "-") for f in attnref.formulations("softmax")]
    + [(f.id, SHAPES[0], True, fm) for f in attnref.formulations("linear") for fm in MAPS]
    + [(f.id, SHAPES[1], False, MAPS[0]) for f in attnref.formulations("linear")]
)


@pytest.mark.parametrize(("fid", "shape", "bias", "fm"), CASES)
def test_model_matches_xla(fid, shape, bias, fm):
    f = attnref.get(fid)
    b, t, h, dm, dk, dv = shape
    dims = Dims(
        b,
        t,
        t,
        h,
        dm,
        dk,
        dv,
        bias=bias,
        feature_map=fm,
        features=2 * dk,
        chunk=5,
        causal=f.causal_modes[0],
    )
    xc = _run(f, dims, fm)
    model = cost(fid, dims)
    mm, el, tr = model.as_counted_by_xla()
    assert xc.dot_flops == mm, f"{fid}: XLA dots {xc.dot_flops} != model {mm}"
    assert xc.transcendentals == tr, f"{fid}: XLA exp {xc.transcendentals} != model {tr}"
    assert 0 <= xc.other_flops <= DUPLICATION * el, (fid, xc.other_flops, el)
    # Memory: XLA must materialise the largest intermediate, and never needs more than every
    # intermediate alive at once plus one (layout) copy of the inputs.
    assert model.intermediate_bytes <= xc.temp_bytes <= model.workspace_bytes, (
        fid,
        model.intermediate_bytes,
        xc.temp_bytes,
        model.workspace_bytes,
    )
    assert model.flops >= model.matmul_flops > 0 and model.output_bytes > 0


def _slope(ts, ys):
    x, y = np.log(np.asarray(ts, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(x, y, 1)[0])


TS = (128, 256, 512)
LOOPED = ("blockwise", "kv_cache")  # softmax forms whose T^2 work runs inside loops


def test_growth_exponents_from_xla():
    """Log-log slopes over T = 128, 256, 512 (B = H = 1, d_model = 8, d_k = d_v = 4, where the
    T^2 terms dominate: the model's linear terms are < 5% of the T^2 ones at T = 128):
    softmax FLOPs and temporary bytes ~ T^2; linear (associative, prefix sums) FLOPs ~ T. The
    blockwise and KV-cache forms never hold a ``T x T`` tensor: their temporary bytes grow
    linearly (XLA's own measurement)."""
    p = attnref.init_params(0, d_model=8, num_heads=1, d_k=4, d_v=4)
    flops, temps = {}, {}
    for t in TS:
        x = np.zeros((1, t, 8), np.float32)
        for f in attnref.formulations("softmax"):
            xc = xla_counts(f.jit(), p, x)
            flops.setdefault(f.id, []).append(xc.flops)
            temps.setdefault(f.id, []).append(xc.temp_bytes)
        for fid in ("linear_associative", "linear_prefix_sum"):
            f = attnref.get(fid)
            xc = xla_counts(
                f.jit(), p, x, feature_map=attnref.linear.elu_plus_one(), causal=f.causal_modes[0]
            )
            flops.setdefault(fid, []).append(xc.flops)
            temps.setdefault(fid, []).append(xc.temp_bytes)
    for f in attnref.formulations("softmax"):
        if f.id in LOOPED:  # XLA counts one tile / one step: the growth is the model's (below)
            assert _slope(TS, temps[f.id]) <= 1.1, (f.id, _slope(TS, temps[f.id]))
            continue
        assert 1.9 <= _slope(TS, flops[f.id]) <= 2.0 + 1e-9, (f.id, _slope(TS, flops[f.id]))
        assert _slope(TS, temps[f.id]) >= 1.9, (f.id, _slope(TS, temps[f.id]))
    # prefix sums: cumsum is an associative scan, O(T log T) additions: slope in (1, 1.1]
    for fid in ("linear_associative", "linear_prefix_sum"):
        assert 0.98 <= _slope(TS, flops[fid]) <= 1.1, (fid, _slope(TS, flops[fid]))
        assert _slope(TS, temps[fid]) <= 1.05, (fid, _slope(TS, temps[fid]))


def test_scan_forms_are_linear_in_the_model():
    """XLA counts a while body once, so the recurrent and chunked forms' growth comes from the
    model, whose per-trip cost is checked against XLA in test_model_matches_xla: FLOPs and the
    largest intermediate grow linearly in T (never as T^2)."""
    for fid in ("linear_recurrent", "linear_chunked"):
        ys = [cost(fid, Dims(1, t, t, 1, 8, 4, 4, chunk=16, causal=True)).flops for t in TS]
        assert abs(_slope(TS, ys) - 1) <= 0.02, fid
        mem = [
            cost(fid, Dims(1, t, t, 1, 8, 4, 4, chunk=16, causal=True)).intermediate_bytes
            for t in TS
        ]
        # the state is O(m d_v) (O(C^2 + m d_v) chunked); projections and outputs are O(T)
        assert abs(_slope(TS, mem) - 1) <= 0.02, fid


def test_looped_softmax_forms_in_the_model():
    """The blockwise and KV-cache forms do the same T^2 work as the others (model FLOPs slope
    2, tiles and steps checked one by one against XLA in test_model_matches_xla); one cached
    decoding step costs O(T_k): its per-step FLOPs and logits grow linearly in the cache size."""
    for fid in LOOPED:
        ys = [cost(fid, Dims(1, t, t, 1, 8, 4, 4)).flops for t in TS]
        assert 1.9 <= _slope(TS, ys) <= 2.0 + 1e-9, fid
    step = [cost("kv_cache", Dims(1, 1, t, 1, 8, 4, 4)) for t in TS]
    assert abs(_slope(TS, [c.per_trip_matmul_flops for c in step]) - 1) <= 1e-9
    assert abs(_slope(TS, [c.per_trip_transcendentals for c in step]) - 1) <= 1e-9


def test_patterns_and_messages_multiply_work_as_the_seeds_claim():
    """Projections: patterns X W_P (one d_model x d_model product) replace the two projections
    X W_Q and X W_K (d_k wide each): T-dependent work grows by d_model / (2 d_k). Logits:
    P_i X^T contracts over d_model instead of d_k: the T^2 term grows by d_model / d_k. The
    same for messages against V and W_O (d_model / (2 d_v)) and for mixing (d_model / d_v).
    Stated from the model and from XLA's dot counts (T-differences cancel forming W_P, W_M)."""
    b, h, dm, dk, dv = 1, 2, 16, 4, 2
    d1, d2 = (Dims(b, t, t, h, dm, dk, dv) for t in (32, 64))

    def model_terms(d):
        t, logits = d.t_q, b * h * d.t_q * d.t_k
        return dict(
            qk_proj=2 * 2 * b * t * dm * h * dk,
            patterns=2 * b * t * dm * h * dm,
            vo_proj=2 * 2 * b * t * dm * h * dv,
            messages=2 * b * t * dm * h * dm,
            qk_logits=2 * logits * dk,
            pattern_logits=2 * logits * dm,
            av_mix=2 * logits * dv,
            message_mix=2 * logits * dm,
        )

    m1, m2 = model_terms(d1), model_terms(d2)
    delta = {k: m2[k] - m1[k] for k in m1}
    assert delta["patterns"] / delta["qk_proj"] == dm / (2 * dk)
    assert delta["messages"] / delta["vo_proj"] == dm / (2 * dv)
    assert delta["pattern_logits"] / delta["qk_logits"] == dm / dk
    assert delta["message_mix"] / delta["av_mix"] == dm / dv
    # The registry models contain exactly these terms: patterns_messages - concat.
    c1, c2 = (cost("concat", d).matmul_flops for d in (d1, d2))
    p1, p2 = (cost("patterns_messages", d).matmul_flops for d in (d1, d2))
    expected = sum(delta[k] for k in ("patterns", "messages", "pattern_logits", "message_mix"))
    expected -= sum(delta[k] for k in ("qk_proj", "vo_proj", "qk_logits", "av_mix"))
    assert (p2 - p1) - (c2 - c1) == expected

    # XLA: the dot FLOPs of each piece, differenced over T.
    p = attnref.init_params(0, d_model=dm, num_heads=h, d_k=dk, d_v=dv)
    w_p, w_m = np.asarray(attnref.interp.w_p(p)), np.asarray(attnref.interp.w_m(p))

    def dots(fn, *args):
        return hlo_dot_flops(jax.jit(fn).lower(*args).compile().as_text())

    def pieces(t):
        x = np.zeros((b, t, dm), np.float32)
        q = np.zeros((b, h, t, dk), np.float32)
        v = np.zeros((b, h, t, dv), np.float32)
        big = np.zeros((b, h, t, dm), np.float32)
        a = np.zeros((b, h, t, t), np.float32)
        ein = jnp.einsum
        return dict(
            qk_proj=dots(
                lambda x: (ein("btd,hde->bhte", x, p.w_q), ein("btd,hde->bhte", x, p.w_k)), x
            ),
            patterns=dots(lambda x: ein("btd,hde->bhte", x, w_p), x),
            vo_proj=dots(
                lambda x, z: (ein("btd,hde->bhte", x, p.w_v), ein("bhtv,hvd->bhtd", z, p.w_o)), x, v
            ),
            messages=dots(lambda x: ein("btd,hde->bhte", x, w_m), x),
            qk_logits=dots(lambda q: ein("bhqd,bhkd->bhqk", q, q), q),
            pattern_logits=dots(lambda pp, x: ein("bhqd,bkd->bhqk", pp, x), big, x),
            av_mix=dots(lambda a, v: ein("bhqk,bhkv->bhqv", a, v), a, v),
            message_mix=dots(lambda a, m: ein("bhqk,bhkd->bhqd", a, m), a, big),
        )

    x1, x2 = pieces(32), pieces(64)
    xd = {k: x2[k] - x1[k] for k in x1}
    assert xd == delta  # XLA's dot counts equal the model term by term
    assert xd["patterns"] / xd["qk_proj"] == dm / (2 * dk)
    assert xd["pattern_logits"] / xd["qk_logits"] == dm / dk


def test_cost_table_covers_every_registered_formulation():
    d = Dims(2, 8, 8, 2, 8, 4, 4, features=8)
    for f in attnref.formulations():
        c = cost(f.id, d)
        assert c.matmul_flops > 0 and c.transcendentals >= 0 and c.intermediate_bytes > 0
    with pytest.raises(KeyError, match="no cost model"):
        cost("nope", d)
