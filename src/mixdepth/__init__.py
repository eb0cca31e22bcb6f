"""mixdepth: scaling-law lab for the Mixture-of-Depths family.

Kept import-free so that torch-free modules (``mixdepth.results``) load without torch.
"""
