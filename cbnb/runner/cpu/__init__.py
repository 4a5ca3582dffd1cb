"""`cbnb.runner.cpu`: what only the CPU path runs: the paged-attention op over the cache (`attention`, torch
references and the C kernels of `cpu_kernels`: ``paged_decode.c``, ``cbnb_exp.h``), the decoder-layer C ops
(`layer_ops`, ``layer_ops.c``; `cpu_layers` routes a model through them), the oneDNN linears (`cpu_linear`), the
compiled forward (`compiled`), OpenMP thread hygiene (`openmp`), and the C noise pass the sampler uses
(``noise.c``, bound by `cbnb.runner.noise`). The C sources are compiled on first use (`cpu_kernels.LazyLibrary`).

Docstring only: importing one module loads only what that module imports."""
