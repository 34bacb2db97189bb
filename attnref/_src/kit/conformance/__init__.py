"""The conformance kit: run attnref's properties against anyone's attention function.

:func:`check_attention` draws problems with :mod:`attnref.strategies`, calls the user's function
through an adapter, compares with the float64 oracle :func:`attnref.oracle.dot_product_attention`
and returns a :class:`ConformanceReport`. Each property is a Hypothesis test (``max_examples``
examples, ``hypothesis.seed(seed)``, no database): a failure comes back shrunk (or as the
explicit example that failed, headed as such), with the sub-case it failed at and the line that
replays it (:meth:`ConformanceReport.replay`).

Shapes: small buckets (``T, S <= 7``, two to four heads, head dim 4) and, for a single-device
target in one example in four (all but ``extreme_logits``), tile-straddling lengths
(:data:`attnref.strategies.TILE_LENGTHS`); ``shapes="production"``: fixed sweeps at tile
boundaries (:func:`production_plan`). ``docs/testing_your_kernel.md`` gives the details.

Properties (each equality with the oracle under the rules of
:func:`attnref.testing.assert_attention_close`):

``oracle``
    Without mask options, the output equals the oracle within
    :func:`attnref.tolerance.kernel_error_bound` (``key_blocks=None``: any tiling of the keys),
    for each requested dtype; 16-bit dtypes by FlashAttention's comparative rule (``"flash"``)
    with :func:`attnref.dot_product_attention` in that dtype as the same-precision reference.
    Inputs include the "identical rows" case (every key, or every query, equal).
``masks``
    Every supported mask option (boolean ``mask``, ``bias`` with ALiBi and ``-inf`` entries,
    ``is_causal`` with ``T != S`` under ``"cross"``, sequence lengths (both, or the one
    declared), a local window, segment ids, softcap, and causal + lengths + mask + bias together)
    equals the oracle run with the declared ``causal_alignment`` and ``masked_rows``. Each example
    draws its boolean mask's and ``-inf`` bias's shape from the 16 that broadcast to ``[B, N, T,
    S]`` (:data:`attnref.strategies.BROADCAST_SHAPES`; ``[B, 1, 1, S]`` is key padding).
``causality`` (needs ``"causal"``)
    Appending future tokens (keys scaled up to 1000x, so a max over future keys would underflow
    the past) changes earlier outputs by at most the sum of the two runs' derived bounds, and
    both runs equal the oracle; with ``"grad"``, ``d out[t] / d{q, k, v}[s]`` is exactly zero
    for every ``s > t``.
``gqa`` (needs ``"gqa"``)
    ``N = 2K`` and ``N = 4K`` equal the oracle; query head ``n`` reads K/V head ``n // (N / K)``.
``lse`` (needs ``"lse"``)
    The lse ``[B, T, N]`` equals the oracle's within its derived bound on rows with an allowed key
    (a fully masked row's is not compared: jax.nn returns a large finite negative, attnref
    ``-inf``), for one kind per example drawn from the unmasked call and the ``masks`` kinds,
    then ``causal`` and ``bias`` where declared.
``batch_independence``
    Each batch element run alone (per-example options sliced with it) equals its slice of the
    batched run within twice the derived bound, NaN in the same places, and both equal the
    oracle (an all-NaN kernel is batch-independent, and wrong).
``fully_masked_rows`` (needs ``"mask"`` or ``"key_value_seq_lengths"``)
    A row with no allowed key returns the declared ``masked_rows`` (``"zeros"``, ``"uniform"``:
    the mean of every ``v`` row, ``"nan"``), and no other row is NaN.
``gradients`` (needs ``"grad"``)
    For each example, one kind drawn from the unmasked call and the ``masks`` kinds, then
    ``causal`` where declared (a masked key's gradient is exactly 0):
    ``dq, dk, dv`` (random output cotangent) equal the float64 gradient oracle
    :func:`attnref.oracle.dot_product_attention_vjp` within
    :func:`attnref.tolerance.kernel_grad_error_bound` (any backward order) in float32 and
    float64; in 16 bits by the comparative rule against attnref's own 16-bit gradients:
    ``max|g - g64| <= 2 max|g16 - g64| + gamma_{N_b}(u) max|g64|``, ``N_b = T G + S + H + H_v +
    2`` the backward's longest reduction.
``extreme_logits``
    With ``max |logit|`` scaled to ``1e2``, ``1e3`` or ``1e4`` in float32, the output is finite
    and equals the oracle within the derived bound (a distributed merge written ``lse + log(1 +
    exp(lse_b - lse))`` overflows here).
``ring_size_growth`` (a distributed kernel only, ``devices=``)
    On each mesh size ``P``, per requested dtype, kinds ``none`` and ``causal``: ``|o_P - o64| <=
    bound + 2 e_1`` componentwise, ``bound`` the merged-states bound
    (:func:`attnref.tolerance.pieces_error_bound`, ``pieces=None``: any partition and merge tree,
    states in float32 or wider, one rounding of the output), ``e_1 = 0`` in float32 and float64,
    in 16 bits the target's own excess on one device ``max(|o_1 - o64| - bound)^+`` (the
    comparative rule's factor 2). A ring rounding its running output to 16 bits at every step
    fails by a factor growing with ``P``.
``uneven_lengths`` (a distributed kernel only, ``devices=``)
    On each ``P`` (1 too), lengths ``2P`` does not divide, kinds ``none`` and ``causal``, the
    first dtype: each call is a clear refusal (:func:`.targets.is_refusal`) or within the
    ``oracle`` allowance; anything else (another exception, NaN, a wrong shape) fails. A passing
    size's detail tallies refused and computed calls.

Distributed kernels (``devices=(1, 2, 4, 8)``): ``fn`` also takes ``mesh=`` (1-D, axis
``"devices"``) and ``axis_name=`` when it names it; ``q, k, v`` are sharded along the sequence
axis where ``P`` divides it. Lengths are multiples of ``2 lcm(devices)`` (but in
``uneven_lengths``), K/V head counts of ``lcm(devices)``. Every property runs on every size (a
:class:`MeshResult` each); a failure names the size.

``refuses_lengths=True`` (a single-device kernel): a clear refusal of the call's lengths (the
rule of ``uneven_lengths``) draws another example, counted in the property's detail with the
first; any other exception still fails. ``head_dim=H``: every example's head dim is ``H``
(small shapes draw 4, production shapes 64, 128 and 256), for a kernel whose matrix units need
more; ``head_dim=(H, H_v)``: the values' head dim is ``H_v`` (an MLA kernel's 192 and 128), the
only way the kit draws ``H_v != H``.

Every property first checks that ``fn`` returned ``[B, T, N, H_v]`` (and, when the lse is asked
for, a pair with an lse ``[B, T, N]``), else fails with both shapes. A failure that is an
exception (``fn`` raised) carries its traceback (:attr:`PropertyResult.traceback`).

Adapters (``signature``; an option keyword is passed only when used):

``"jax_nn"``
    ``fn(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None)``, the layout of
    :func:`jax.nn.dot_product_attention`; the lse by ``return_residual=True`` or
    ``return_lse=True``, whichever ``fn`` takes; segment ids and softcap as attnref's keywords.
    Jitted per static option set (eagerly, noted, if tracing fails).
``"qkv_mask"``
    ``fn(q, k, v, mask)``, ``mask [B, N, T, S]`` boolean (``True`` = may attend) expressing every
    option; the oracle sees that mask alone (a padded query row is fully masked).
``"numpy"``
    ``"jax_nn"`` with NumPy arrays in and out; no jit, no gradients.
``"torch"``
    ``fn(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False)``, as
    ``torch.nn.functional.scaled_dot_product_attention`` (:mod:`.torch_target`): CPU tensors
    ``[B, N, T, H]``, ``attn_mask`` boolean or additive, ``is_causal`` top-left; gradients by
    autograd; no lse, lengths, windows or segments. Needs ``pip install 'attnref[torch]'``.
"""
