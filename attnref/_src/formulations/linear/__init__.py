"""Linear (kernel) attention (Katharopoulos et al. 2020): the kernel-level forms (``kernel``),
the multi-head forms (``multihead``), their shared pieces (``common``), and the ``LINEAR``
family with its cost models and registry entries (``family``; importing the package registers
them).
"""

from attnref._src.formulations.linear.family import LINEAR  # noqa: F401  (and registers the forms)
