#!/usr/bin/env bash
# Prepare, on a machine with PyPI, what `scripts/gpu-check.sh` needs on a GPU machine that has
# no internet: the wheels its Python lacks, in ./.whl (ignored by git). The GPU machine this was
# written for has Python 3.12 with CUDA torch, transformers, accelerate, peft and the rest of
# assay's needs already installed; these are the ones it lacks (pure Python, or built for
# manylinux x86_64), about 14 MB: assay's own requirements, TRL for the benchmark, diffusers
# for the image policies (with requests, which it imports), and pytest. pip installs from here
# only what the machine does not already have.
#
#   scripts/gpu-prepare.sh                     # for Python 3.12 (the default)
#   GPU_PYTHON=3.11 scripts/gpu-prepare.sh     # for another Python
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=${GPU_PYTHON:-3.12}
WHEELS=(
  pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  trl==1.16.0 setuptools==84.2.1 typing-extensions==4.16.0
  peft==0.21.2
  diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0 zipp==4.1.2 xxhash==4.1.0
  requests==2.34.2 urllib3==2.8.0 idna==3.21 certifi==2026.10.19.post1 charset_normalizer==3.5.3
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0
)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
echo "gpu-prepare: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1), in .whl (carry it with the project)" >&2
