#!/usr/bin/env bash
# Fetch, into .whl/, the wheels that a CUDA machine with Python 3.12 and torch (but no package
# index) needs to run scripts/gpu-checks.sh: the project's pinned packages that its image lacks.
# Run it here, where pip reaches an index; .whl/ stays out of git (add it to .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    diffusers==0.42.1 transformers==5.23.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
    importlib_metadata==10.2.0 regex==2026.11.19 redis==8.1.0
ls .whl
