"""Linear (kernel) attention in every form (Katharopoulos et al. 2020, "Transformers are RNNs").

- :mod:`~attnref._src.formulations.linear.kernel`: the kernel-level forms (quadratic,
  associative, prefix sum, recurrent with :class:`LinearState`, chunked), each opening with its
  formula, and the denominator policy;
- :mod:`~attnref._src.formulations.linear.multihead`: the one multi-head body behind
  ``linear_<form>_attention``, and ``linear_messages_attention``;
- :mod:`~attnref._src.formulations.linear.common`: the options, validation and the two levels'
  inputs (``run``/``dirty_rows`` for :func:`attnref._src.core.entry.guard`);
- :mod:`~attnref._src.formulations.linear.family`: the ``LINEAR`` family, the cost models and the
  registry entries (importing the package registers them).
"""

from attnref._src.formulations.linear.family import LINEAR  # noqa: F401  (and registers the forms)
