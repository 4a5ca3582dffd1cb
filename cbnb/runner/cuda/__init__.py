"""`cbnb.runner.cuda`: the GPU path: `cuda_runner.CudaModelRunner` (packed static metadata, CUDA graphs per padded
shape, async double-buffered batching), its graph machinery and step shapes (`graphs`), the Triton paged-attention
kernels and their torch references (`triton_attention`), and the environment checks (`device_checks`). On CPU the
same code runs with fake graphs and the torch references (the tests).

Docstring only: importing one module loads only what that module imports."""
