"""The C++ CPU kernels (`csrc/`): attention over pool cells and a layer's row-wise pieces.

`loader.cpu_kernel()` builds them once per machine and returns the module
(or None, where no compiler is found).
"""
