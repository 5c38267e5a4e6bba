#!/usr/bin/env bash
# test.py and the tests that read torch's private state (the internals, checkpointing, replica
# rounds) on the torch release that a bare `pip install torch` gives users today (a CUDA wheel;
# it runs on the CPU), in an environment of its own: the suite runs on the CPU build that this
# machine holds. About 4 minutes from nothing (a 3 GB download); the environment is kept in
# $TORCH_RELEASE_ENV for the next run.
#
#   tools/test_torch_release.sh           # TORCH_RELEASE_ENV (default: /tmp/syncbn-torch-release),
#                                         # TORCH_RELEASE (default: torch==2.15.0), PYTHON (python)
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/env_tree.sh
ENV=${TORCH_RELEASE_ENV:-/tmp/syncbn-torch-release}
make_env "$ENV" "${TORCH_RELEASE:-torch==2.15.0}" -r requirements.txt -r requirements-build.txt pytest hypothesis pytest-timeout
build_tree "$ENV"
cd "$ENV/tree"
"$ENV/bin/python" test.py
"$ENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_torch_internals.py tests/test_torch_internals_checkpoint.py \
    tests/test_checkpoint.py tests/test_checkpoint_generated.py tests/test_checkpoint_failures.py tests/test_drop_in.py \
    tests/test_replicas_failures.py tests/test_replicas_waits.py tests/test_replicas_stock_rounds.py tests/test_replicas_meetings.py
