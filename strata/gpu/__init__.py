"""GPU-side tooling that is not a kernel: building llama.cpp with CUDA as Strata's same-run peer."""
