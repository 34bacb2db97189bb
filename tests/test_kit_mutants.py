"""Issue 22, "Planted bugs that survive": every single-device property of the conformance kit
(:data:`attnref.testing.PROPERTIES`) has a broken kernel that it alone catches, so a property
that stops looking (ignores its drawn mask shape, its dtypes, its MQA bucket, ...) turns a test
red here instead of passing silently.

The mutants (``tests/kit_mutants.py``; each a plain jnp kernel with one defect, checked with
the features ``mask, bias, causal, gqa, lse, grad``, so that no property is skipped):

* ``oracle``: ``float64_in_float32`` computes float64 inputs in float32. Only ``oracle`` runs
  every requested dtype (here float32 and float64); the others run float32 alone.
* ``masks``: ``bias_row0_only`` applies a bias that broadcasts over the query axis
  (``[.., 1, S]``) to query row 0 only. Only ``masks`` draws a bias's broadcast shape (and runs
  ``[1, 1, 1, S]`` first whatever the seed); ``lse`` and ``batch_independence`` use biases with
  a full query axis.
* ``causality``: ``backward_masks_future_with_minus_60`` has an exact forward, but its backward
  masks future keys with a logit offset of -60 instead of ``-inf``. The gradient with respect to
  future keys and values is about ``1e-26``, not exactly 0. Only ``causality`` demands exact
  zeros there; ``gradients``' bound absorbs the leak.
* ``gqa``: ``mqa_folded_causal``'s one-K/V-head fast path folds the query heads into the query
  axis and applies the causal mask to the folded row index. Only ``gqa`` runs an MQA problem with
  ``is_causal``: oracle's MQA bucket has no mask, and the masked properties' buckets have two K/V
  heads.
* ``lse``: ``lse_base2`` returns the right output with the lse in base 2. Only ``lse`` asks for
  the lse.
* ``batch_independence``: ``batch1_drops_mask`` drops ``mask`` and ``bias`` in a batch-1 fast
  path. Only ``batch_independence`` runs a batch of 1 with a mask or a bias (each element alone);
  without ``cross`` there is no ``tall`` bucket, and oracle's and gqa's MQA bucket (batch 1) has
  neither.
* ``fully_masked_rows``: ``key_padding_rows_uniform`` gives a fully masked row the mean of ``v``
  instead of the declared zeros, but only under a mask that broadcasts over the query axis. Only
  ``fully_masked_rows`` builds rows with no allowed key, and only in the mask shape it draws (its
  default ``[B, 1, T, S]`` takes the right path). The test checks that the failing draw's
  ``mask_shape`` has ``T = 1``.
* ``gradients``: ``dq_dk_without_scale`` has a bit-exact forward, but its backward leaves the
  logit scale out of ``dq`` and ``dk``. Only ``gradients`` compares gradients with the oracle;
  ``causality``'s future gradients stay exactly 0.
* ``extreme_logits``: ``row_max_floor_zero`` starts the row max at 0 instead of ``-inf``, so a
  row whose logits all lie far below 0 underflows. Only ``extreme_logits`` draws such rows:
  ``causality`` scales the future keys by 1000, but every row also reads unscaled past keys.

Two more mutants are seen only through a drawn mask kind: ``masked_dv_leak`` gives masked pairs
the weight ``1e-3`` in ``dv``'s backward under a boolean mask (``gradients`` draws a kind besides
``causal`` for each example), and ``lse_without_mask`` takes the lse over the masked keys too
(``lse`` draws a kind besides ``causal`` and ``bias``).

Each test makes two calls with the same features, semantics and seed: the property alone
(``CATCH_EXAMPLES``) must fail, with the planted defect named in its detail; every other property
(``PASS_EXAMPLES``, kept small because this half runs eight properties) must pass, none skipped.
Together the passing halves show that the unbroken kernel passes every property, eight mutants
per property.
"""

from __future__ import annotations

import re

import pytest

from attnref.testing import PROPERTIES, check_attention

from .kit_mutants import FEATURES, MUTANTS, lse_without_mask, masked_dv_leak

SEED = 0
CATCH_EXAMPLES = 8  # the property alone (it stops at the first failure, then shrinks)
PASS_EXAMPLES = 2  # each of the eight other properties

# property -> a pattern its failure detail must match (the planted defect, not another)
DETAIL = {
    "oracle": r"oracle \[float64\]: ",
    # a bias broadcast over the query axis: [*, *, 1, S]
    "masks": r"masks \[neg_inf_bias: \{bias=float32\[\d+, \d+, 1, \d+\]\}\]: ",
    "causality": r"causality: d out\[:, \d+\] / d [kv]\[",
    "gqa": r"gqa \[N=4, K=1, causal\]: ",
    "lse": r"lse \[\w+\]: rule ",
    "batch_independence": r"batch element \d run alone differs from its slice",
    "fully_masked_rows": r"fully masked row .* returns the mean of v over all keys",
    "gradients": r"gradients \[\w+\]: d/d[qk] off the float64 gradient oracle",
    "extreme_logits": r"extreme logits \[max \|logit\| = \d+, \w+\]: ",
}


def test_every_property_has_a_mutant():
    assert list(MUTANTS) == list(PROPERTIES) == list(DETAIL)


@pytest.mark.parametrize("prop", PROPERTIES)
def test_only_its_property_catches_the_mutant(prop):
    fn, extra = MUTANTS[prop]
    common = dict(features=FEATURES, seed=SEED, **extra)
    caught = check_attention(fn, properties=[prop], max_examples=CATCH_EXAMPLES, **common)
    (r,) = caught.results
    assert r.status == "failed", caught.summary()
    assert re.match(DETAIL[prop], r.detail), r.detail
    if prop == "fully_masked_rows":  # caught through the mask shape it drew, not its default
        shape = re.search(r"mask_shape='(\w{4})'", r.example or "")
        assert shape and shape.group(1)[2] == "1", r.example
    others = [p for p in PROPERTIES if p != prop]
    rest = check_attention(fn, properties=others, max_examples=PASS_EXAMPLES, **common)
    assert [x.name for x in rest.results] == others
    assert all(x.status == "passed" for x in rest.results), rest.summary()


@pytest.mark.parametrize(
    ("fn", "prop", "detail"),
    [
        (
            masked_dv_leak,
            "gradients",
            r"gradients \[random\]: d/dv off the float64 gradient oracle",
        ),
        (lse_without_mask, "lse", r"lse \[random\]: rule "),
    ],
    ids=["gradients", "lse"],
)
def test_a_drawn_mask_kind_catches_the_mutant(fn, prop, detail):
    common = dict(features=FEATURES, seed=SEED)
    caught = check_attention(fn, properties=[prop], max_examples=CATCH_EXAMPLES, **common)
    (r,) = caught.results
    assert r.status == "failed", caught.summary()
    assert re.match(detail, r.detail), r.detail
    others = [p for p in PROPERTIES if p != prop]
    rest = check_attention(fn, properties=others, max_examples=PASS_EXAMPLES, **common)
    assert all(x.status == "passed" for x in rest.results), rest.summary()
