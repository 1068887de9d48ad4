"""The torch path: every stage's computation in plain torch, run where Triton does not (CPU
tensors without the interpreter; the torch GEMM backend on any device).

Each module mirrors one kernel module and produces the same results (the layouts bit for bit):
`layouts` (the GEMM layouts' metadata, permute, unpermute), `activation` (the count-aware
activation), `gemm` (the expert GEMM, used by `padded_moe.backends.torch_backend`). The
expert-parallel stages keep their torch path next to their kernels' launchers in
`padded_moe.distributed`. The float64 test oracle is elsewhere (`padded_moe.reference`) and
shares no code with this package.
"""
