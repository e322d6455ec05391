import os

# These tests launch Triton kernels on CPU tensors through Triton's interpreter, which
# has to be on before triton is first imported; tests/test_triton_kernels.py runs this
# directory in a subprocess with TRITON_INTERPRET=1.
if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "tests/interpreted needs TRITON_INTERPRET=1 (run through "
        "tests/test_triton_kernels.py, or set it yourself)"
    )
