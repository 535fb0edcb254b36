"""CPU kernels behind FeatCal's block loop: which library multiplies float32 matrices (`gemm`), the
products torch has no CPU kernel for (`mkl_products`), block-upper-triangle Grams (`gram`),
allocation-lean activations (`activations`), patch embeddings as one product (`convolutions`),
NaN/Inf checks in one pass (`finite`) and glibc's memory reuse during a run (`memory`).

Private: the calibrator and the statistics choose them; results are the same as torch's own paths bit
for bit or to float32 rounding, as each module says. Their measurements are in docs/scale.md ("The
CPU kernels").
"""
