"""Building a CUDA source of `kestrel.ops` into a shared library for the current device, cached: nvcc compiles it
for the device's compute capability into $KESTREL_CACHE_DIR/cuda (default ~/.cache/kestrel/cuda), one file per
hash of the source, the arch, the nvcc version and the flags, which ctypes then loads (the CUDA top-k,
`kestrel.ops.dsa.cuda_topk`, and the GEMV chain experiment, `kestrel.ops.linear.cuda_chain`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kestrel.env import env_field

FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")


def find_nvcc() -> str | None:
    """The nvcc that builds the kernels: $CUDA_HOME/bin (or $CUDA_PATH/bin), /usr/local/cuda/bin, then PATH."""
    candidates = []
    cuda_home = env_field("cuda_home")
    if cuda_home:
        candidates.append(Path(cuda_home) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("nvcc")


def cache_dir() -> Path:
    root = env_field("cache_dir") or str(Path.home() / ".cache" / "kestrel")
    return Path(root) / "cuda"


def build(source: Path, nvcc: str | None, flags: tuple[str, ...] = FLAGS, verbose: bool = False) -> Path:
    """Compile `source` for the current device with `nvcc` (cached) and return the shared library's path."""
    if nvcc is None:
        raise RuntimeError("nvcc not found (CUDA_HOME/bin, /usr/local/cuda/bin, PATH)")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    flags = (*flags, f"-arch={arch}")
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode() + version.encode()).hexdigest()[
        :16
    ]
    cache = cache_dir()
    lib = cache / f"{source.stem}_{arch}_{digest}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp.so", dir=cache)
    os.close(fd)
    cmd = [nvcc, *flags, "-o", tmp, str(source)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        if verbose and done.stderr:
            print(done.stderr)
        os.replace(tmp, lib)  # atomic: a concurrent build of the same source writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
