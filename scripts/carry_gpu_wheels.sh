#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, pinned, downloaded here for the device tool's `carry` (it reaches no registry).
#
#   scripts/carry_gpu_wheels.sh [DEST] [PYTHON_VERSION]    # defaults: .whl (ignored by git) and 3.12 (the image's)
#
# The image (its package list, read 2026-11-17) holds torch 2.11, triton 3.6, transformers 5.17 (below
# nnterp's 5.18), huggingface-hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, accelerate, jaxtyping, einops, httpx,
# cloudpickle, pyyaml, tqdm, numpy; not nnsight, fla, nor nnsight's needs below. typing-extensions and regex are there
# at versions nobody read, below what pydantic and transformers 5.24 ask for perhaps: carried, they shadow them.
# huggingface-hub 1.33.0 and einops are the image's own, carried so that the CPU stand-in of the image
# (tests/test_gpu_carry.py: a newer hub, needing httpx2; no einops, which fla-core needs) runs what the machine runs.
# causal-conv1d and mamba-ssm are left out: sources only on PyPI (no cp312 wheel), a CUDA build longer than a lease;
# without them transformers runs its pure-torch convolution and Mamba-2 scan, and benchmarks/gpu.py says which it bound.
# The device command that installs these is in benchmarks/gpu.py's docstring and docs/performance.md's GPU section;
# tests/test_gpu_carry.py downloads them for its own Python and runs that command on the CPU.
set -euo pipefail
dest=${1:-.whl}
python=${2:-3.12}
wheels=(
    transformers==5.24.0 nnsight==0.8.1 flash-linear-attention==0.6.0 fla-core==0.6.0
    greenlet==3.5.6 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 websocket-client==1.9.2 zstandard==0.25.0 regex==2026.12.2
    huggingface-hub==1.33.0 einops==0.8.2
)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
    "${platforms[@]}" -d "$dest" "${wheels[@]}"
echo "$(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest for Python $python"
