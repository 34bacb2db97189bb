"""The conformance kit: run attnref's properties against anyone's attention function.

:func:`check_attention` draws problems with :mod:`attnref.strategies`, calls the user's function
through an adapter, compares with the float64 oracle :func:`attnref.oracle.dot_product_attention`
and returns a :class:`ConformanceReport`. Each property is a Hypothesis test run programmatically
(``max_examples`` examples, ``hypothesis.seed(seed)``, no example database), so a failure comes
back with Hypothesis's shrunk falsifying example (or the explicit example that failed, headed as
such), the sub-case it failed at, and the Python line that replays it
(:meth:`ConformanceReport.replay`: the same options and seed).

Shapes: a few small buckets (``T, S <= 7``, two to four heads, head dim 4), where Hypothesis
shrinks to, and for a single-device target in one example in four (every property but
``extreme_logits``) a bucket with tile-straddling lengths: ``T`` and ``S`` from
:data:`attnref.strategies.TILE_LENGTHS` (15 to 513: ``n - 1, n, n + 1, 3n/2 + 1, 2n + 1``
around tiles ``n`` of 16 to 256), where a kernel's last, partial tile is. A tail-tile fault
therefore fails the default run, shrunk to the shortest length that fails.
``shapes="production"`` sweeps longer lengths, more heads and head dims.

Properties (each equality with the oracle uses the tolerance rules of
:func:`attnref.testing.assert_attention_close`):

``oracle``
    On problems without mask options, the output equals the oracle within
    :func:`attnref.tolerance.kernel_error_bound` (``key_blocks=None``: valid for any tiling of the
    keys), for each requested dtype. 16-bit dtypes use FlashAttention's comparative rule
    (``"flash"``) instead, with :func:`attnref.dot_product_attention` computed in that dtype as the
    same-precision reference: a 16-bit kernel's output is rounded to 16 bits, and the comparative
    rule is how kernel projects judge that rounding. Inputs include the "identical rows" special
    case (every key, or every query, equal), drawn on purpose.
``masks``
    Every supported mask option (boolean ``mask``, ``bias`` including ALiBi and ``-inf`` entries,
    ``is_causal`` with ``T != S`` when ``"cross"`` is supported, sequence lengths (both, or the
    one declared: ``query_seq_lengths`` or ``key_value_seq_lengths`` alone), a local window,
    segment ids, softcap, and all of causal + lengths + mask + bias together) equals the oracle run
    with the declared ``causal_alignment`` and ``masked_rows``. Every example checks every option,
    and draws the shape of its boolean mask and of its ``-inf`` bias from all 16 that broadcast
    to ``[B, N, T, S]`` (:data:`attnref.strategies.BROADCAST_SHAPES`; ``[B, 1, 1, S]`` is the
    key-padding mask).
``causality`` (needs ``"causal"``)
    Appending future tokens (with keys scaled up to 1000x, so that a max taken over future keys
    would underflow the past) leaves earlier outputs unchanged within the sum of the two runs'
    derived bounds, and both runs equal the oracle; with ``"grad"``, the gradient of output row
    ``t`` with respect to ``q``, ``k`` and ``v`` at every position after ``t`` is exactly zero.
``gqa`` (needs ``"gqa"``)
    ``N = 2K`` and ``N = 4K`` problems equal the oracle; query head ``n`` reads K/V head
    ``n // (N / K)`` (consecutive groups, as in GQA and MQA).
``lse`` (needs ``"lse"``)
    The returned log-sum-exp ``[B, T, N]`` equals the oracle's within its derived bound (rows
    with an allowed key; a fully masked row's lse is not compared, since jax.nn returns a large
    finite negative where attnref returns ``-inf``).
``batch_independence``
    Each batch element run alone (every per-example option sliced with it) equals its slice of the
    batched run within twice the derived bound, with NaN in the same places, and both runs equal
    the oracle (an all-NaN kernel is batch-independent, and wrong).
``fully_masked_rows`` (needs ``"mask"`` or ``"key_value_seq_lengths"``)
    A query row with no allowed key returns the declared ``masked_rows`` meaning (``"zeros"``,
    ``"uniform"``: the mean of every ``v`` row, ``"nan"``), and no other row is NaN.
``gradients`` (needs ``"grad"``)
    The gradients with respect to ``q``, ``k``, ``v`` (for a random output cotangent) equal the
    float64 NumPy gradient oracle :func:`attnref.oracle.dot_product_attention_vjp` (analytic, no
    autodiff): within :func:`attnref.tolerance.kernel_grad_error_bound` (derived, any backward
    order) in float32 and float64; in 16 bits by FlashAttention's comparative rule with
    attnref's own 16-bit gradients as the same-precision reference:
    ``max|g - g64| <= 2 max|g16 - g64| + gamma_{N_b}(u) max|g64|``, ``N_b = T G + S + H + H_v +
    2`` the longest reduction of the backward pass.
``extreme_logits``
    With ``q`` and ``k`` scaled so that ``max |logit|`` is ``1e2``, ``1e3`` or ``1e4`` in float32,
    the output is finite and equals the oracle within the derived bound. (A distributed kernel's
    pieces then have log-sum-exps hundreds apart: a merge written ``lse + log(1 + exp(lse_b -
    lse))`` overflows here.)
``ring_size_growth`` (a distributed kernel only, ``devices=``)
    On each mesh size ``P``, for each requested dtype and the kinds ``none`` and ``causal``:
    ``|o_P - o64| <= bound + 2 e_1`` componentwise, ``bound`` the derived bound of merged
    states (:func:`attnref.tolerance.pieces_error_bound` with ``pieces=None``: any partition of
    the keys merged in any tree, every key its own piece at worst, states in float32 or wider;
    so it holds for a ring whose devices tile their own chunk too, at any ``|lse|``),
    ``e_1 = 0`` in float32 and float64 and, in 16 bits, the target's own excess over the bound
    on one device, ``e_1 = max(|o_1 - o64| - bound)^+`` (the kit's comparative rule: a kernel
    that stores 16-bit intermediates, as FlashAttention stores ``P``, may do so on ``P``
    devices at most twice as badly, but merging pieces may add no 16-bit rounding). The bound
    allows one rounding of the output to 16 bits, so a ring that rounds its running output to
    16 bits at every step (ring-flash-attention #42) fails, by a factor that grows with ``P``.
    The report gives, per size, the worst error / allowance over the examples.
``uneven_lengths`` (a distributed kernel only, ``devices=``)
    On each mesh size ``P`` (``P = 1`` included: a zigzag layout cuts the sequence in ``2P``
    chunks), lengths that ``2P`` does not divide (a bucket's plus an offset from ``1 .. 2P - 1``,
    drawn apart for ``T`` and ``S`` in the ``T != S`` bucket), kinds ``none`` and ``causal``, in
    the first dtype (float32 when requested). Each call is a refusal (an exception of
    :data:`.targets.REFUSAL_TYPES` whose message contains one of :data:`.targets.REFUSAL_WORDS`,
    case-insensitive: ``jax.shard_map``'s "not evenly divisible" ``ValueError``,
    ``jax.numpy``'s "cannot reshape array" ``TypeError``) or an answer within the ``oracle``
    property's allowance for a distributed kernel; anything else fails (another exception, an
    ``AssertionError`` too: ``python -O`` strips it; NaN where the oracle is finite; a wrong
    shape). A passing size's detail tallies the calls: the first refusal's ``"refused: <Type>:
    <first line>"``, how many were refused and computed (``docs/testing_your_kernel.md``). A
    kernel that pads to a multiple of ``2P`` and forgets to mask the padded keys fails
    (EasyContext #57).

Distributed kernels (``devices=(1, 2, 4, 8)``): ``fn`` takes jax.nn's arguments plus ``mesh=``
(a 1-D ``jax.sharding.Mesh``, axis ``"devices"``, over the first ``P`` of ``jax.devices()``) and
``axis_name="devices"`` when it names that parameter; ``q, k, v`` are global arrays sharded along
the sequence axis (``NamedSharding``) where ``P`` divides their length, else replicated. Every
length is a multiple of ``2 lcm(devices)`` (the buckets' lengths times that), so that a
contiguous, striped or zigzag layout of every size divides it, except in ``uneven_lengths``,
which draws the lengths ``2P`` does not divide. Every K/V head count (so every query head count)
is a multiple of ``lcm(devices)``: the buckets' heads are scaled up with their ratio ``N / K``
kept (``K = 8`` on meshes of 1, 2, 4 and 8, the MQA bucket's one K/V head included), so a
head-parallel kernel (Ulysses, tensor parallelism) splits them on every size; a
sequence-parallel one ignores them. Every property runs on every size (one :class:`MeshResult`
each, in :attr:`PropertyResult.meshes`); a failure names the size.

A declared limit (``refuses_lengths=True``, a single-device kernel): a clear refusal of the
call's lengths (the rule of ``uneven_lengths``) draws another example instead of failing, and the
property's detail counts the refused calls and gives the first; any other exception still fails.

Every property first checks that ``fn`` returned an output ``[B, T, N, H_v]`` (and, when the lse
is asked for, a pair whose lse is an array ``[B, T, N]``), and fails with both shapes otherwise.
A failure that is an exception rather than a failed comparison (``fn`` raised) carries its
traceback (:attr:`PropertyResult.traceback`).

Adapters (``signature``):

``"jax_nn"``
    ``fn(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None)`` with the
    layout of :func:`jax.nn.dot_product_attention`; an option keyword is passed only when used.
    The lse is requested with ``return_residual=True`` (jax.nn) or ``return_lse=True`` (attnref),
    whichever ``fn`` accepts; ``"segment_ids"`` and ``"softcap"`` are passed as attnref's keywords.
    ``fn`` is wrapped in ``jax.jit`` (per static option set, so compilations are reused across
    examples); if tracing fails, it runs eagerly and the results say so.
``"qkv_mask"``
    ``fn(q, k, v, mask)`` with ``mask [B, N, T, S]`` boolean (``True`` = may attend); causality,
    windows, lengths and segments are expressed through the mask, and the oracle is run with that
    mask alone (so a padded query row is a fully masked row).
``"numpy"``
    The ``"jax_nn"`` calling convention with NumPy arrays in and out; no jit, no gradients.
``"torch"``
    ``fn(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False)``
    with the conventions of ``torch.nn.functional.scaled_dot_product_attention``: CPU tensors
    ``[B, N, T, H]`` (bfloat16 converted through float32, exactly), ``attn_mask`` boolean
    (``True`` = may attend) or an additive float, ``is_causal`` top-left, ``enable_gqa=True``
    when ``N != K``; each keyword passed only when used. Gradients by autograd; no lse, lengths,
    windows or segments (:mod:`.torch_target`). Needs PyTorch (``pip install 'attnref[torch]'``).

Modules: :mod:`.options` (the accepted names and the check of each option), :mod:`.report`,
:mod:`.targets` (loading the target, the meshes, the adapter that calls it), :mod:`.references`
(attnref's own passes, the comparisons with the oracle), :mod:`.context` (the buckets, what a
plan draws from), :mod:`.plans` (the eleven properties), :mod:`.engine` (the Hypothesis runner,
:func:`check_attention`), :mod:`.states` (:func:`check_merge_states`); the closeness rules live
in :mod:`attnref._src.kit.closeness`.

``shapes="production"`` replaces the Hypothesis draws by fixed sweeps at tile boundaries
(:mod:`attnref._src.kit.conformance.production`; :func:`production_plan` lists them).
"""
