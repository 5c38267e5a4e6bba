#!/usr/bin/env bash
# tests/test_timm.py, tests/test_torchvision.py and tests/test_model_libraries.py with the real timm,
# torchvision, Ultralytics and segmentation_models_pytorch, in an
# environment of their own: timm needs torchvision,
# whose wheels load only with the torch build they were made for, and the CPU build of torch that
# the suite uses has no torchvision in the package registry. So this makes a virtual environment
# with a CUDA wheel of torch (it runs on the CPU), its torchvision and timm, builds the compiled
# kernels against that torch in a copy of the tree (the suite's build stays as it is), and runs
# the timm tests there. About 5 minutes from nothing (a 3 GB download); the environment is kept
# in $TIMM_ENV for the next run.
#
#   tools/test_timm.sh                    # TIMM_ENV (default: /tmp/syncbn-timm-env), PYTHON (python)
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/env_tree.sh
ENV=${TIMM_ENV:-/tmp/syncbn-timm-env}
make_env "$ENV" torch==2.14.1 torchvision==0.29.1 timm opencv-python-headless -r requirements.txt -r requirements-build.txt pytest hypothesis pytest-timeout
# the model libraries without their dependency pins (which would replace this torch); opencv is all Ultralytics imports beyond them
"$ENV/bin/python" -m pip install --quiet --no-deps ultralytics==8.4.190 segmentation-models-pytorch==0.6.0
build_tree "$ENV"
cd "$ENV/tree" && "$ENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_timm.py tests/test_torchvision.py tests/test_model_libraries.py
