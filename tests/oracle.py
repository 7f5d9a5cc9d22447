"""What the tests share about the per-example definition of the clipped sum.

The certified floating-point bound (workbench/privacy/clipping/bound.py) clips each example against an upper bound on the
norm of what its kernel adds, so an example is clipped up to gamma_K S / N harder than its exact norm asks (README:
0.004 % on the MLP to about 0.15 % on the tiny BERT; the toy layers here sit in that range). A clipped sum is compared with
the float64 per-example definition within ``CLIPPED_RTOL``: room for that margin, far below what a wrong norm, a
missing term or an unclipped example moves it by.
"""

CLIPPED_RTOL = 3e-3
