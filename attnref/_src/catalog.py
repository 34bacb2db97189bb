"""Registry entries of the core formulations (one ``register`` call each), and the helpers.

The export rule (checked by ``tests/test_docs_pages.py``): every registered formulation's
``native`` and ``apply`` are exported from ``attnref`` under their ``__name__``, the name its page
shows; every exported function taking the registry's row signature ``(params, x_q, x_kv, ...)``
is a registered ``native``/``apply`` or is listed in :data:`HELPERS` with the reason it is not a
registry entry, and the page of the formulation it belongs to shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from attnref._src import cost, cost_rope
from attnref._src.blockwise import blockwise_attention
from attnref._src.column import column_attention, column_attention_rows
from attnref._src.decode import cache_attend
from attnref._src.graph import graph_attention, graph_attention_rows
from attnref._src.kernel_forms import blockwise_multihead, decode_multihead, kv_cache_multihead
from attnref._src.linear import (
    linear_associative,
    linear_associative_multihead,
    linear_chunked,
    linear_chunked_multihead,
    linear_messages_attention,
    linear_prefix_sum,
    linear_prefix_sum_multihead,
    linear_quadratic,
    linear_quadratic_multihead,
    linear_recurrent,
    linear_recurrent_multihead,
)
from attnref._src.merged import patterns_messages_attention, scores_messages_attention
from attnref._src.probes import attention_logits, attention_probes, residual_update
from attnref._src.registry import Formulation, register
from attnref._src.rope import rope_attention, rope_patterns_attention
from attnref._src.soft_search import soft_search, soft_search_attention
from attnref._src.standard import (
    attention_weights,
    concat_attention,
    head_outputs,
    per_head_sum_attention,
)

VASWANI = "Vaswani et al. (2017), Attention Is All You Need, NeurIPS."
REFACTOR = (
    "Refactoring the Attention Equations: Patterns and Messages (blog post, 2025-02-19); "
    "Reframing Attention: A Matrix Decomposition Perspective (blog post, 2025-02-18)."
)
ELHAGE = (
    "Elhage et al. (2021), A Mathematical Framework for Transformer Circuits, Transformer "
    "Circuits Thread; column form as written in Attention: All you need to know "
    "(far.in.net, 2025-03-29)."
)
KARPATHY = (
    "Karpathy (2023), Stanford CS25 lecture on transformers, attention as message exchange; as "
    "presented in Attention: All you need to know (far.in.net, 2025-03-29)."
)

register(
    Formulation(
        id="concat",
        title="Concatenated heads with one W_O",
        equation=(
            r"\mathrm{MultiHead}(X_q, X_{kv}) = \mathrm{Concat}(\mathrm{head}_1,\dots,\mathrm{head}_H)"
            r"\,W_O + b_O,\quad \mathrm{head}_i = \mathrm{softmax}\!\Big(\frac{Q_i K_i^\top}"
            r"{\sqrt{d_k}}\Big) V_i"
        ),
        convention="row",
        citation=VASWANI,
        apply=concat_attention,
        native=concat_attention,
        summary="The textbook form: heads concatenated along features, one stacked output matrix.",
        cost="FLOPs O(H (T_q + T_k) d_model (d_k + d_v) + H T_q T_k (d_k + d_v)); memory O(H T_q T_k) for the weights.",
        cost_model=cost.concat_cost,
    )
)

register(
    Formulation(
        id="per_head_sum",
        title="Per-head sum of head_i W_O_i",
        equation=(
            r"\mathrm{MultiHead}(X_q, X_{kv}) = \sum_{i=1}^{H} \mathrm{head}_i\, W_{O,i} + b_O,"
            r"\quad \mathrm{head}_i = \mathrm{softmax}\!\Big(\frac{Q_i K_i^\top}{\sqrt{d_k}}\Big) V_i"
        ),
        convention="row",
        citation=VASWANI + " Split of W_O by head: " + REFACTOR,
        apply=per_head_sum_attention,
        native=per_head_sum_attention,
        summary="W_O split into per-head blocks; each head writes to model space and the writes add.",
        cost="As concat, plus O(H T_q d_v d_model) for per-head outputs held before the sum; memory O(H T_q T_k + H T_q d_model).",
        cost_model=cost.per_head_sum_cost,
    )
)

register(
    Formulation(
        id="scores_messages",
        title="Scores x messages (W_M = W_V W_O)",
        equation=(
            r"\sum_{i=1}^{H} \mathrm{softmax}\!\Big(\frac{Q_i K_i^\top}{\sqrt{d_k}}\Big)\,M_i + b_O,"
            r"\quad M_i = X_{kv} W_{M,i} + \mathbf{1}\, b_{V,i} W_{O,i},\quad W_{M,i} = W_{V,i} W_{O,i}"
        ),
        convention="row",
        citation=REFACTOR,
        apply=scores_messages_attention,
        native=scores_messages_attention,
        summary="Value and output projections merged into a d_model x d_model message matrix.",
        cost="FLOPs O(H d_model^2 d_v) to form W_M, O(H T_k d_model^2) for messages, O(H T_q T_k d_model) to mix; memory O(H T_k d_model + H T_q T_k). Mixing costs d_model / d_v times the concat form's.",
        cost_model=cost.scores_messages_cost,
    )
)

register(
    Formulation(
        id="patterns_messages",
        title="Patterns x messages (W_P = W_Q W_K^T)",
        equation=(
            r"\sum_{i=1}^{H} \mathrm{softmax}\!\Big(\frac{P_i X_{kv}^\top}{\sqrt{d_k}}\Big)\,M_i + b_O,"
            r"\quad P_i = X_q W_{P,i} + \mathbf{1}\, b_{Q,i} W_{K,i}^\top,"
            r"\quad W_{P,i} = W_{Q,i} W_{K,i}^\top"
        ),
        convention="row",
        citation=REFACTOR,
        apply=patterns_messages_attention,
        native=patterns_messages_attention,
        summary="Query and key projections merged into a pattern matrix; scale stays 1/sqrt(d_k).",
        cost="FLOPs O(H d_model^2 (d_k + d_v)) to form W_P and W_M, O(H (T_q + T_k) d_model^2) for patterns and messages, O(H T_q T_k d_model) for logits and mixing; memory O(H (T_q + T_k) d_model + H T_q T_k).",
        cost_model=cost.patterns_messages_cost,
    )
)

register(
    Formulation(
        id="column",
        title="Column-vector form (Elhage et al. 2021)",
        equation=(
            r"Y = \sum_{i=1}^{H} W_{I,i} X_{kv}\, \sigma\!\big(X_{kv}^\top W_{A,i} X\big) + b_O"
            r"\mathbf{1}^\top,\quad W_{A,i} = W_{K}^\top W_{Q},\ W_{I,i} = W_{O}^\top W_{V}"
            r"\ \text{(column convention)}"
        ),
        convention="column",
        citation=ELHAGE,
        apply=column_attention_rows,
        native=column_attention,
        summary="Tokens as columns (d_model x T); sigma is a scaled, masked column softmax.",
        cost="As patterns_messages (the same products, transposed); memory O(H (T_q + T_k) d_model + H T_q T_k).",
        cost_model=cost.column_cost,
    )
)

register(
    Formulation(
        id="soft_search",
        title="Per-query soft search",
        equation=(
            r"o = \sum_{i=1}^{H} \mathrm{softmax}\!\Big(\frac{X_{kv}\, p_i^\top}{\sqrt{d_k}}\Big)^{\!\top}"
            r" M_i + b_O,\quad p_i = x_q W_{P,i} + b_{Q,i} W_{K,i}^\top"
        ),
        convention="single-query",
        citation="Refactoring the Attention Equations: Patterns and Messages (2025-02-19), "
        "single-query version; search perspective of Attention: All you need to know (2025-03-29).",
        apply=soft_search_attention,
        native=soft_search,
        summary="One query vector at a time searches the keys with its pattern; vmapped over queries.",
        cost="As patterns_messages: written one query at a time, but vmap leaves the query-independent work (W_P, W_M and the messages X_kv W_M) unbatched, so it is computed once (XLA's FLOP count equals patterns_messages'); memory O(H (T_q + T_k) d_model + H T_q T_k)",
        cost_model=cost.soft_search_cost,
    )
)

register(
    Formulation(
        id="graph",
        title="Graph message passing over an edge list",
        equation=(
            r"y_r = \sum_{i=1}^{H} \Big(\sum_{e=(s\to r)} \alpha_{e,i}\, v_{s,i}\Big) W_{O,i} + b_O,"
            r"\quad \alpha_{\cdot,i} = \mathrm{segment\_softmax}_r\!\big(q_{r,i}\cdot k_{s,i}"
            r"/\sqrt{d_k}\big)"
        ),
        convention="graph",
        citation=KARPATHY,
        apply=graph_attention_rows,
        native=graph_attention,
        summary="Tokens are nodes, the mask is the adjacency; a segment softmax per receiver.",
        cost="FLOPs O(H (N_r + N_s) d_model (d_k + d_v) + H E (d_k + d_v)) for E edges (E = T_q T_k for the dense adjacency); memory O(H E (d_k + d_v)) for gathered per-edge keys and values.",
        cost_model=cost.graph_cost,
    )
)

# ----------------------------------------------------------------------------- linear attention

KATHAROPOULOS = (
    "Katharopoulos et al. (2020), Transformers are RNNs: Fast Autoregressive Transformers with "
    "Linear Attention, ICML."
)
CHOROMANSKI = "Choromanski et al. (2021), Rethinking Attention with Performers, ICLR (FAVOR+)."
LINEAR_STATIC = ("causal", "eps_policy", "residual")
_LIN_EQ = r"y_i = \frac{\sum_{j \in \mathcal{A}(i)} \phi(q_i)^\top \phi(k_j)\, v_j^\top}{\sum_{j \in \mathcal{A}(i)} \phi(q_i)^\top \phi(k_j) + \epsilon}"

register(
    Formulation(
        id="linear_quadratic",
        title="Linear attention, quadratic form",
        equation=r"Y = \frac{(\phi(Q)\phi(K)^\top \odot M)\, V}{(\phi(Q)\phi(K)^\top \odot M)\,\mathbf{1} + \epsilon},\quad "
        + _LIN_EQ,
        convention="kernel",
        citation=KATHAROPOULOS + " Feature maps: " + CHOROMANSKI,
        apply=linear_quadratic_multihead,
        native=linear_quadratic,
        summary="The T x T kernel matrix materialised, masked (causal and/or key padding), row-normalised.",
        cost="FLOPs O(H T_q T_k (m + d_v)); memory O(H T_q T_k). m = number of features.",
        cost_model=cost.linear_quadratic_cost,
        family="linear",
        causal_modes=(False, True),
        static_argnames=LINEAR_STATIC,
    )
)

register(
    Formulation(
        id="linear_associative",
        title="Linear attention, associative (non-causal) form",
        equation=r"Y = \frac{\phi(Q)\,\big(\phi(K)^\top V\big)}{\phi(Q)\,\big(\phi(K)^\top \mathbf{1}\big) + \epsilon}",
        convention="kernel",
        citation=KATHAROPOULOS,
        apply=linear_associative_multihead,
        native=linear_associative,
        summary="Associativity turns O(T^2 d) into O(T m d_v): keys and values are summarised first.",
        cost="FLOPs O(H (T_q + T_k) m d_v); memory O(H m d_v): linear in T.",
        cost_model=cost.linear_associative_cost,
        family="linear",
        causal_modes=(False,),
        static_argnames=LINEAR_STATIC,
    )
)

register(
    Formulation(
        id="linear_prefix_sum",
        title="Linear attention, causal prefix sums",
        equation=r"S_t = \sum_{j \le t} \phi(k_j) v_j^\top,\ z_t = \sum_{j \le t} \phi(k_j),\quad y_t = \frac{\phi(q_t)^\top S_t}{\phi(q_t)^\top z_t + \epsilon}",
        convention="kernel",
        citation=KATHAROPOULOS,
        apply=linear_prefix_sum_multihead,
        native=linear_prefix_sum,
        summary="Cumulative sums of phi(k) v^T and phi(k) give every causal prefix at once.",
        cost="FLOPs O(H T m d_v); memory O(H T m d_v) for the prefix states.",
        cost_model=cost.linear_prefix_sum_cost,
        family="linear",
        causal_modes=(True,),
        static_argnames=LINEAR_STATIC,
    )
)

register(
    Formulation(
        id="linear_recurrent",
        title="Linear attention, recurrent (RNN) form",
        equation=r"S_t = S_{t-1} + \phi(k_t) v_t^\top,\ z_t = z_{t-1} + \phi(k_t),\quad y_t = \frac{\phi(q_t)^\top S_t}{\phi(q_t)^\top z_t + \epsilon}",
        convention="kernel",
        citation=KATHAROPOULOS,
        apply=linear_recurrent_multihead,
        native=linear_recurrent,
        summary="A lax.scan over the constant-size state (S_t, z_t): the decoding view, O(m d_v) memory.",
        cost="FLOPs O(H T m d_v) in T sequential steps; memory O(H m d_v), constant in T (the KV-cache analogue).",
        cost_model=cost.linear_recurrent_cost,
        family="linear",
        causal_modes=(True,),
        static_argnames=LINEAR_STATIC,
    )
)

register(
    Formulation(
        id="linear_chunked",
        title="Linear attention, chunked form",
        equation=r"y_t = \frac{\phi(q_t)^\top \big(S_{c-1} + \sum_{j \in c,\, j \le t} \phi(k_j) v_j^\top\big)}{\phi(q_t)^\top \big(z_{c-1} + \sum_{j \in c,\, j \le t} \phi(k_j)\big) + \epsilon},\ t \in \text{chunk } c",
        convention="kernel",
        citation=KATHAROPOULOS + " Chunkwise evaluation as in later linear-attention kernels.",
        apply=linear_chunked_multihead,
        native=linear_chunked,
        summary="Quadratic inside each chunk, the state carried between chunks by lax.scan; any chunk size.",
        cost="FLOPs O(H T (C (m + d_v) + m d_v)) for chunk size C, T / C sequential steps; memory O(H (C^2 + m d_v)).",
        cost_model=cost.linear_chunked_cost,
        family="linear",
        causal_modes=(True,),
        static_argnames=(*LINEAR_STATIC, "chunk_size"),
    )
)

register(
    Formulation(
        id="linear_messages",
        title="Linear attention, scores x messages",
        equation=r"Y = \sum_{i=1}^{H} \mathrm{rownorm}\big(\phi(Q_i)\phi(K_i)^\top \odot M\big)\, \big(X_{kv} W_{M,i}\big) + b_O",
        convention="row",
        citation=KATHAROPOULOS + " Messages view: " + REFACTOR,
        apply=linear_messages_attention,
        native=linear_messages_attention,
        summary="The normalised linear attention matrix of each head times its messages X W_M.",
        cost="FLOPs O(H T_q T_k (m + d_model) + H T_k d_model^2); memory O(H T_q T_k + H T_k d_model).",
        cost_model=cost.linear_messages_cost,
        family="linear",
        causal_modes=(False, True),
        static_argnames=LINEAR_STATIC,
    )
)

# ----------------------------------------------------------------------------- kernel era

MILAKOV = (
    "Milakov & Gimelshein (2018), Online normalizer calculation for softmax, arXiv:1805.02867."
)
DAO = (
    "Dao et al. (2022), FlashAttention: Fast and Memory-Efficient Exact Attention with "
    "IO-Awareness, NeurIPS."
)
GQA = (
    "Ainslie et al. (2023), GQA: Training Generalized Multi-Query Transformer Models from "
    "Multi-Head Checkpoints, EMNLP; Shazeer (2019), Fast Transformer Decoding: One Write-Head is "
    "All You Need (MQA)."
)
ROFORMER = (
    "Su et al. (2021), RoFormer: Enhanced Transformer with Rotary Position Embedding, "
    "arXiv:2104.09864."
)

register(
    Formulation(
        id="blockwise",
        title="Blockwise online softmax (the flash form)",
        equation=(
            r"m' = \max(m, \max_j s_{ij}),\ \ \ell' = e^{m - m'}\ell + \sum_{j \in B}"
            r" e^{s_{ij} - m'},\ \ a' = e^{m - m'} a + \sum_{j \in B} e^{s_{ij} - m'} v_j,"
            r"\quad o_i = a / \ell = \mathrm{softmax}(s_i) V,\ \ \mathrm{lse}_i = m + \log \ell"
        ),
        convention="kernel",
        citation=MILAKOV + " " + DAO + " GQA: " + GQA,
        apply=blockwise_multihead,
        native=blockwise_attention,
        summary=(
            "Query tiles (lax.map) times key tiles (lax.scan) with a running max and sum; the "
            "backward is a custom_vjp that recomputes tiles from the saved lse."
        ),
        cost=(
            "FLOPs as concat plus O(H T_q T_k / B_k) rescalings; memory O(H (T_q + T_k) d + "
            "B_q B_k H) temporaries: linear in T (no T_q x T_k tensor)."
        ),
        cost_model=cost.blockwise_cost,
        static_argnames=("residual", "block_q", "block_k"),
    )
)

register(
    Formulation(
        id="kv_cache",
        title="KV-cached attention, one query per step",
        equation=(
            r"\mathcal{C} = \{(p_j, k_j, v_j)\}_{j < T_k},\quad o_t = \sum_{i=1}^{H}"
            r" \mathrm{softmax}_{j \in \mathcal{C}}\!\Big(\frac{q_{t,i} k_{j,g(i)}^\top}"
            r"{\sqrt{d_k}} + b_{t, p_j}\Big) v_{j,g(i)} W_{O,i} + b_O"
        ),
        convention="kernel",
        citation=(
            "Incremental decoding with cached keys and values as in Vaswani et al. (2017) and "
            "every decoder since; " + GQA
        ),
        apply=kv_cache_multihead,
        native=cache_attend,
        summary=(
            "Keys and values projected once into a cache (slots with absolute positions), then a "
            "lax.scan reads it one query at a time; masks and biases index absolute positions."
        ),
        cost=(
            "FLOPs as concat; memory O(H T_k (d_k + d_v)) for the cache plus O(H T_k) logits per "
            "step: no T_q x T_k tensor."
        ),
        cost_model=cost.kv_cache_cost,
    )
)

ROPE_STATIC = ("residual", "base", "convention")

register(
    Formulation(
        id="rope",
        title="Rotary position embedding (rotate q and k)",
        equation=(
            r"s_{ij} = \frac{\big(q_i R(m_i)\big)\big(k_j R(n_j)\big)^\top}{\sqrt{d_k}},"
            r"\quad R(m) = \bigoplus_{p} \begin{pmatrix} \cos m\theta_p & \sin m\theta_p \\"
            r" -\sin m\theta_p & \cos m\theta_p \end{pmatrix},\ \theta_p = b^{-2p/d_k}"
        ),
        convention="row",
        citation=ROFORMER,
        apply=rope_attention,
        native=rope_attention,
        summary=(
            "Queries and keys rotated pairwise by position-dependent angles (rotate-half or "
            "interleaved pairs); values untouched."
        ),
        cost="As concat plus O(H (T_q + T_k) d_k) for the rotations; memory O(H T_q T_k).",
        cost_model=cost_rope.rope_cost,
        family="rope",
        static_argnames=ROPE_STATIC,
    )
)

register(
    Formulation(
        id="rope_patterns",
        title="RoPE as a relative-position pattern matrix",
        equation=(
            r"s_{ij} = \frac{\tilde x_i\, W_P(m_i - n_j)\, \tilde x_j^\top}{\sqrt{d_k}},"
            r"\quad W_P(\delta) = \tilde W_Q\, R(\delta)\, \tilde W_K^\top,"
            r"\quad \tilde x = [x, 1],\ \tilde W = [W; b]"
        ),
        convention="row",
        citation=ROFORMER + " Pattern view: " + REFACTOR,
        apply=rope_patterns_attention,
        native=rope_patterns_attention,
        summary=(
            "The pattern matrix becomes a function of the offset m - n: one d_model x d_model "
            "W_P per distinct offset, gathered per (query, key) pair."
        ),
        cost=(
            "FLOPs O(H n_delta d_model^2 d_k) to form W_P(delta) for n_delta offsets, O(H T_q "
            "T_k d_model^2) for the logits; memory O(H T_q T_k d_model)."
        ),
        cost_model=cost_rope.rope_patterns_cost,
        family="rope",
        static_argnames=ROPE_STATIC,
    )
)


# ----------------------------------------------------------------------------- helpers


class Helper(NamedTuple):
    """An exported function with the registry's row signature that is not a registry entry."""

    fn: Callable[..., Any]
    formulation: str  # the id of the registry entry whose page lists it
    reason: str  # why it is not an entry (Markdown, shown on that page)


_PROBE = "A probe of the block (see [probes](../probes.md)), not the block output: "

HELPERS: tuple[Helper, ...] = (
    Helper(
        decode_multihead,
        "kv_cache",
        "The `kv_cache` computation fed one token per `lax.scan` step (`attnref.mha_decode_scan`: "
        "token `t` appends its key and value, then its query attends to the cache). It is always "
        "causal and needs `T_q == T_k`, so it cannot take the softmax family's arbitrary masks "
        "and cross-attention; `tests/test_registry.py` checks it against the oracle with a "
        "causal mask.",
    ),
    Helper(
        attention_weights,
        "per_head_sum",
        _PROBE + "the weights `A_i` of every query head. `tests/test_registry.py` checks that it "
        "equals the `scores` field of `attnref.attention_probes` bit for bit, which "
        "`tests/test_probes.py` checks against the oracle.",
    ),
    Helper(
        head_outputs,
        "per_head_sum",
        _PROBE + "the per-head terms `o_i = head_i W_O[i]` (no `b_O`). `tests/test_registry.py` "
        "checks `sum_i o_i + b_O` against the oracle's output with the derived bound.",
    ),
    Helper(
        attention_logits,
        "scores_messages",
        _PROBE + "the masked pre-softmax logits. `tests/test_probes.py` checks that it equals "
        "the `logits` field of `attnref.attention_probes` bit for bit and those against a derived "
        "bound.",
    ),
    Helper(
        attention_probes,
        "scores_messages",
        _PROBE + "every intermediate at once, as a pytree; `tests/test_probes.py` checks each "
        "field against the oracle.",
    ),
    Helper(
        residual_update,
        "scores_messages",
        "The residual form `x_q + y` computed from `attnref.attention_probes` (scores times "
        "messages): the same function as every formulation's `apply` with `residual=True`, "
        "which the registry tests; `tests/test_probes.py` checks the two agree.",
    ),
)
