"""Pieces several ops share: the Triton-or-reference rule, launch helpers, row layouts, segment kernels.

Ops import these modules directly and never each other: ``dispatch`` (``use_triton``), ``launch`` (column
blocks, dot precision), ``rows`` (the two routed index layouts), ``segments`` (CSR build and segmented
reduction), ``scatter_backward`` (gradients of a routed scatter-add).
"""
