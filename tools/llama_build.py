"""A CUDA build of llama.cpp's two benchmark tools from the source vendored in llama-cpp-python.

The GPU machine reaches no network, so the source travels with the working
tree (64 MiB a call). The whole vendored tree is 60 MB; `make_bundle` keeps
what `llama-bench` and `llama-batched-bench` need (ggml with its CPU and
CUDA backends, libllama, common, vendor, the two tools) and swaps
tools/CMakeLists.txt for one that adds only those two, about 5 MB gzipped.

`build_command` configures for one architecture (sm_90: the H200) and builds
only the two targets. What cuts the build time: one CUDA architecture
instead of llama.cpp's default list, flash-attention kernels for f16 K/V only
(the tools' default cache type) instead of four type pairs, no NCCL, no
tests, examples, server or app, Ninja with every core.

    python -m tools.llama_build bundle VENDORED_LLAMA_CPP_DIR .lcpp/llama-src.tar.gz
    python -m tools.llama_build command .lcpp/llama-src.tar.gz .lcpp   # prints the shell line
"""

from __future__ import annotations

import argparse
import io
import shlex
import sys
import tarfile
from pathlib import Path

ROOT = "llama.cpp"  # top folder inside the bundle
KEEP = [  # paths (files or folders) of the vendored tree that the two tools' build reads
    "CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "vendor",
    "ggml/CMakeLists.txt", "ggml/cmake", "ggml/include", "ggml/src/ggml-cpu", "ggml/src/ggml-cuda",
    "tools/llama-bench", "tools/batched-bench",
]
GGML_SRC_FILES = (".c", ".cpp", ".h", ".in", ".txt")  # ggml/src's own files (not its backends)
TOOLS_CMAKE = """# the two benchmark tools only (a trimmed source tree: the other tools are not in it)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
"""
TARGETS = ("llama-bench", "llama-batched-bench")
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_CUDA": "ON",
    "CMAKE_CUDA_ARCHITECTURES": "90",  # the H200 only
    "GGML_NATIVE": "OFF",
    "GGML_CUDA_FA_ALL_QUANTS": "OFF",
    "GGML_CUDA_FA_QUANTS": "f16-f16",  # flash-attention instances for the default f16 cache only
    "GGML_CUDA_NCCL": "OFF",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_SERVER": "OFF",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_COMMON": "ON",
}


def _skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    name = info.name
    if "/.git" in name or "/__pycache__" in name or name.endswith((".pyc", ".o")):
        return None
    return info


def make_bundle(src: Path, out: Path) -> int:
    """Write the trimmed source tree of `src` (llama.cpp) to `out` (.tar.gz); returns its size."""
    src = Path(src)
    if not (src / "ggml" / "src" / "ggml-cuda").is_dir():
        raise FileNotFoundError(f"{src} is not a llama.cpp source tree with ggml-cuda")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz", compresslevel=9) as tar:
        for rel in KEEP:
            tar.add(src / rel, arcname=f"{ROOT}/{rel}", filter=_skip)
        for f in sorted((src / "ggml" / "src").iterdir()):
            if f.is_file() and f.name.endswith(GGML_SRC_FILES):
                tar.add(f, arcname=f"{ROOT}/ggml/src/{f.name}")
        data = TOOLS_CMAKE.encode()
        info = tarfile.TarInfo(f"{ROOT}/tools/CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.stat().st_size


# Where nvcc's toolkit lacks cuBLAS (a compiler-only install), take the pip wheel's
# (nvidia-cublas, which PyTorch uses): its headers, and its libraries by full path;
# likewise the driver library when the toolkit has no stub of it.
CUBLAS_FALLBACK = (
    'T=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); X=""; '
    'if [ ! -f "$T/include/cublas_v2.h" ]; then '
    'H=$(find / -xdev -name cublas_v2.h -path "*nvidia*" 2>/dev/null | head -1); '
    'L=$(find / -xdev -name "libcublas.so*" -path "*nvidia*" 2>/dev/null | head -1); '
    'LT=$(find / -xdev -name "libcublasLt.so*" -path "*nvidia*" 2>/dev/null | head -1); '
    'I=$(dirname "$H"); '
    'X="-DCUDA_cublas_LIBRARY=$L -DCUDA_cublasLt_LIBRARY=$LT -DCMAKE_CXX_FLAGS=-I$I '
    '-DCMAKE_CUDA_FLAGS=-I$I -DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath,$(dirname "$L")"; fi; '
    'if ! ls "$T"/lib64/stubs/libcuda.so "$T"/lib64/libcuda.so "$T"/lib/stubs/libcuda.so >/dev/null 2>&1; then '
    'D=$(find / -xdev -name "libcuda.so*" 2>/dev/null | head -1); '
    '[ -n "$D" ] && X="$X -DCUDA_cuda_driver_LIBRARY=$D"; fi; '
)


def build_command(bundle: str, workdir: str, jobs: int = 16) -> str:
    """One shell line: unpack `bundle` into `workdir`, configure, build the two tools.

    The binaries land in WORKDIR/build/bin; a second run with them present
    does nothing (a warm machine keeps ignored folders between calls).
    """
    w = shlex.quote(workdir)
    src = f"{w}/{ROOT}"
    opts = " ".join(f"-D{k}={shlex.quote(v)}" for k, v in CMAKE_OPTIONS.items())
    return (
        f"if [ ! -x {w}/build/bin/llama-bench ] || [ ! -x {w}/build/bin/llama-batched-bench ]; then "
        f"mkdir -p {w} && tar -xzf {shlex.quote(bundle)} -C {w} && {CUBLAS_FALLBACK}"
        f"cmake -S {src} -B {w}/build -G Ninja {opts} $X && "
        f"cmake --build {w}/build -j {jobs} --target {' '.join(TARGETS)}; fi"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.llama_build", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="write the trimmed source bundle")
    b.add_argument("src")
    b.add_argument("out")
    c = sub.add_parser("command", help="print the build command for the GPU machine")
    c.add_argument("bundle")
    c.add_argument("workdir")
    c.add_argument("--jobs", type=int, default=16)
    args = p.parse_args(argv)
    if args.cmd == "bundle":
        size = make_bundle(Path(args.src), Path(args.out))
        print(f"{args.out}: {size / 1e6:.1f} MB")
    else:
        print(build_command(args.bundle, args.workdir, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
