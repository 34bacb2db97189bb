"""Fill the worked MiniLM examples of docs/probes.md (reproducible; no randomness).

    python scripts/probes_minilm.py            # rewrites the generated blocks in place
    python scripts/probes_minilm.py --check    # exit 1 if docs/probes.md is out of date

Every block between ``<!-- BEGIN minilm:NAME -->`` and ``<!-- END minilm:NAME -->`` in
docs/probes.md is regenerated from all-MiniLM-L6-v2 (``attnref[models]``) in float64. Heads are
chosen by a stated rule, never by hand.

Vocabulary table. Layer 0 reads ``x = LN(E_word[t] + E_pos[p] + E_type[0])``; the examples
use that row for every whole-word ASCII token ``t`` (no ``##`` pieces, specials or other
scripts) at position ``p = 5``, so a dot product of a pattern with a table row is exactly the
logit (up to the ``b_K`` term, constant per query) that a key token ``t`` at position 5 would
get.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import jax
import numpy as np

import attnref
from attnref.interp import (
    attention_probes,
    composition_baseline,
    composition_scores,
    effective_rank,
    message_svd,
    pattern_svd,
    top_aligned,
)
from attnref.models import bert_hidden_states, layer_attention, load_minilm

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "probes.md"
SENTENCE = "The cat sat on the mat because it was tired."
POSITION = 5
K = 8


def _ln(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def vocab_table(model) -> tuple[np.ndarray, list[str]]:
    w = model.weights
    vocab = model.vocab()
    keep = [i for i, t in enumerate(vocab) if t.isascii() and t.isalpha()]
    rows = np.asarray(w.word)[keep] + np.asarray(w.position)[POSITION] + np.asarray(w.token_type)[0]
    table = _ln(rows, np.asarray(w.ln_gamma), np.asarray(w.ln_beta), model.config.layer_norm_eps)
    return table, [vocab[i] for i in keep]


def position_rows(model, params, x_query: np.ndarray) -> list[str]:
    """Per layer-0 head: the key position (1..12) with the largest logit for the query row,
    keys being the word ``the`` at each position (the position table seen through a pattern)."""
    w = model.weights
    the = model.tokenizer.token_to_id("the")
    keys = np.asarray(w.word)[the] + np.asarray(w.position)[1:13] + np.asarray(w.token_type)[0]
    keys = _ln(keys, np.asarray(w.ln_gamma), np.asarray(w.ln_beta), model.config.layer_norm_eps)
    pats = np.asarray(attention_probes(params, x_query[None]).patterns)[:, 0]  # [H, d]
    logits = pats @ keys.T
    best = np.argmax(logits, axis=-1) + 1
    return [
        f"Positions: with the key word fixed to `the` at positions 1 to 12, the position with "
        f"the largest logit for this query at position {POSITION} ({POSITION} is the query's "
        f"own position, {POSITION - 1} the previous token), per head:",
        "",
        "| head | " + " | ".join(str(h) for h in range(len(best))) + " |",
        "|---|" + "---|" * len(best),
        "| best key position | " + " | ".join(str(int(b)) for b in best) + " |",
    ]


def words(idx: np.ndarray, names: list[str]) -> str:
    return ", ".join(f"`{names[int(i)]}`" for i in idx)


def generate() -> dict[str, str]:
    model = load_minilm(np.float64)
    layers = layer_attention(model.weights)
    ids, mask = model.tokenize([SENTENCE], pad_multiple=1)
    tokens = [model.tokenizer.id_to_token(int(i)) for i in ids[0]]
    with jax.enable_x64(True):
        hidden = np.asarray(
            bert_hidden_states(model.weights, ids, mask, config=model.config, all_layers=True)
        )
    out: dict[str, str] = {}
    t_it, t_cat = tokens.index("it"), tokens.index("cat")

    # --- scores: the head (any layer) that puts most weight from "it" on "cat".
    best = max(
        (
            (float(np.asarray(attention_probes(p, hidden[i][0]).scores)[h, t_it, t_cat]), i, h)
            for i, p in enumerate(layers)
            for h in range(p.num_heads)
        )
    )
    w_it, li, hi = best
    pr = attention_probes(layers[li], hidden[li][0])
    scores = np.asarray(pr.scores)[hi]
    row = " | ".join(f"{s:.2f}" for s in scores[t_it])
    out["scores"] = "\n".join(
        [
            f"Sentence: *{SENTENCE}* ({len(tokens)} tokens with `[CLS]` and `[SEP]`). Rule: the "
            f"head, over all 72, with the largest score from `it` to `cat` is layer {li}, head "
            f"{hi} ($A_{{it,cat}} = {w_it:.3f}$). Its row for the query `it`:",
            "",
            "| " + " | ".join(f"`{t}`" for t in tokens) + " |",
            "|" + "---|" * len(tokens),
            "| " + row + " |",
            "",
            "The median over heads of the same entry is "
            f"{np.median([np.asarray(attention_probes(p, hidden[i][0]).scores)[:, t_it, t_cat] for i, p in enumerate(layers)]):.3f}.",  # noqa: E501
        ]
    )

    # --- per-head outputs: norms of o_i for the token "it" in that layer; sum check.
    o = np.asarray(pr.head_outputs)[:, t_it]  # [H, d]
    norms = np.linalg.norm(o, axis=-1)
    y = np.asarray(attnref.concat_attention(layers[li], hidden[li][0]))[t_it]
    b_o = np.asarray(layers[li].b_o)
    gap = float(np.abs(o.sum(0) + b_o - y).max())
    order = np.argsort(-norms)
    out["head_outputs"] = "\n".join(
        [
            f"Layer {li}, query `it`: the norms $\\lVert o_i \\rVert$ of the 12 per-head outputs "
            f"(the block output has norm {np.linalg.norm(y):.2f}; $\\lVert b_O \\rVert = "
            f"{np.linalg.norm(b_o):.2f}$):",
            "",
            "| head | " + " | ".join(str(h) for h in range(12)) + " |",
            "|---|" + "---|" * 12,
            "| norm | " + " | ".join(f"{n:.2f}" for n in norms) + " |",
            "",
            f"The three largest are heads {', '.join(str(int(h)) for h in order[:3])}. "
            f"$\\max |\\sum_i o_i + b_O - \\mathrm{{concat}}(x)| = {gap:.1e}$ (float64).",
        ]
    )

    # --- patterns and messages of layer 0 for a word, aligned with the vocabulary table.
    table, names = vocab_table(model)
    p0 = layers[0]
    word = "cat"
    x = table[names.index(word)]
    pr0 = attention_probes(p0, x[None])
    pats = np.asarray(pr0.patterns)[:, 0]  # [H, d]
    msgs = np.asarray(pr0.messages)[:, 0]
    # Rule: the layer-0 head whose pattern for "cat" gives the largest logit spread over the
    # table (max minus median), i.e. the most selective head for this query.
    logits = pats @ table.T / np.sqrt(p0.d_k)
    spread = logits.max(-1) - np.median(logits, -1)
    h0 = int(np.argmax(spread))
    _, top_keys = top_aligned(pats[h0], table, K, metric="dot")
    _, low_keys = top_aligned(-pats[h0], table, K, metric="dot")
    out["patterns"] = "\n".join(
        [
            f"Layer 0, query word `{word}` at position {POSITION}. Rule: the head whose pattern "
            f"$p = x W_P + b_Q W_K^\\top$ is most selective over the vocabulary table (largest "
            f"max-minus-median logit) is head {h0}. Dot products with the table are the logits "
            f"$p \\cdot x_t / \\sqrt{{d_k}}$ a key word $t$ at position {POSITION} would get:",
            "",
            f"* highest: {words(np.asarray(top_keys), names)}",
            f"* lowest: {words(np.asarray(low_keys), names)}",
            "",
            *position_rows(model, p0, x),
        ]
    )
    _, top_m = top_aligned(msgs[h0], table, K, metric="cosine")
    _, top_m_all = top_aligned(msgs, table, 3, metric="cosine")
    out["messages"] = "\n".join(
        [
            f"Layer 0, head {h0}, the message $m = x W_M + b_V W_O$ that `{word}` would send. "
            "Table rows by cosine similarity with $m$ (what the message looks like in the input "
            "embedding space; the message is added to the receiving token's residual stream, "
            "so this says which words' directions it pushes the receiver towards):",
            "",
            f"* head {h0}: {words(np.asarray(top_m), names)}",
            "",
            "The top 3 for every layer-0 head (same rule):",
            "",
            "| head | top 3 by cosine |",
            "|---|---|",
            *[f"| {h} | {words(np.asarray(top_m_all)[h], names)} |" for h in range(12)],
        ]
    )

    # --- spectra: singular directions of W_P for head h0.
    svd = pattern_svd(p0)
    s = np.asarray(svd.s)[h0]
    left, right = np.asarray(svd.left)[h0], np.asarray(svd.right)[h0]
    lines = [
        f"Layer 0, head {h0}: singular values of $W_P$ (computed from the factors, float64): "
        + ", ".join(f"{v:.2f}" for v in s[:6])
        + f", ..., {s[-1]:.3f}; entropy effective rank {float(effective_rank(s)):.1f} of 32. "
        "The top three singular pairs, each as the table words best aligned (cosine) with the "
        "query-side direction $u_k$ and the key-side direction $v_k$ (a query along $u_k$ "
        "looks for keys along $v_k$; signs of a pair flip together):",
        "",
        "| k | sigma_k | query side u_k | key side v_k |",
        "|---|---|---|---|",
    ]
    for k in range(3):
        _, qu = top_aligned(left[:, k], table, 5)
        _, kv = top_aligned(right[:, k], table, 5)
        lines.append(
            f"| {k} | {s[k]:.2f} | {words(np.asarray(qu), names)} | "
            f"{words(np.asarray(kv), names)} |"
        )
    erank_m = float(np.mean(np.asarray(effective_rank(np.asarray(message_svd(p0).s)))))
    lines += ["", f"Mean entropy effective rank of $W_M$ over layer 0's heads: {erank_m:.1f}."]
    out["spectra"] = "\n".join(lines)

    # --- composition between layers 0 and 1.
    lines = [
        "Scores from every head of layer $l$ to every head of layer $l + 1$; the largest "
        "score of each kind, the mean, and the random-matrix baseline "
        "(`composition_baseline`, 8 draws of Gaussian heads of the same shapes):",
        "",
        "| layers | kind | max (h1 -> h2) | mean | random baseline |",
        "|---|---|---|---|---|",
    ]
    for li in range(len(layers) - 1):
        for kind in "qkv":
            sc = np.asarray(composition_scores(layers[li], layers[li + 1], kind))
            h1, h2 = np.unravel_index(int(np.argmax(sc)), sc.shape)
            base = composition_baseline(layers[li], layers[li + 1], kind)
            lines.append(
                f"| {li} -> {li + 1} | {kind.upper()} | {sc.max():.3f} ({h1} -> {h2}) | "
                f"{sc.mean():.3f} | {base:.3f} |"
            )
    out["composition"] = "\n".join(lines)
    return out


def fill(text: str, blocks: dict[str, str]) -> str:
    for name, body in blocks.items():
        pat = re.compile(
            rf"(<!-- BEGIN minilm:{name} -->\n)(?:.*?\n)?(<!-- END minilm:{name} -->)", re.DOTALL
        )
        if not pat.search(text):
            raise SystemExit(f"docs/probes.md has no block minilm:{name}")
        text = pat.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    old = DOC.read_text()
    new = fill(old, generate())
    if args.check:
        if new != old:
            print("docs/probes.md is out of date: run python scripts/probes_minilm.py")
            sys.exit(1)
        return
    DOC.write_text(new)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
