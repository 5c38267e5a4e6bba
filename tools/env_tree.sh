# Sourced by the scripts that test the project in an environment of its own (tools/test_timm.sh,
# tools/test_torch_release.sh): a virtual environment with the packages asked for, and a copy of
# the tree with the compiled kernels built against that environment's torch (the suite's build
# stays as it is).

# make_env ENV PIP_ARGS...: the virtual environment ENV (kept for the next run), with PIP_ARGS
# installed in it. No constraint of the machine's pip applies: each script names its torch.
make_env() {
  local env=$1
  shift
  [ -x "$env/bin/python" ] || "${PYTHON:-python}" -m venv "$env"
  : > "$env/no-constraints.txt"
  PIP_CONSTRAINT="$env/no-constraints.txt" "$env/bin/python" -m pip install --quiet "$@"
}

# build_tree ENV: the tracked and untracked (not ignored) files copied to ENV/tree, the CPU
# kernels built there with ENV's python; prints the build's log where it fails.
build_tree() {
  local env=$1 tree="$1/tree"
  rm -rf "$tree" && mkdir -p "$tree"
  git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$tree"
  (cd "$tree" && SYNCBN_CUDA=0 PYTHON_CMD="$env/bin/python" ./make_ext.sh > "$env/build.log" 2>&1) \
    || { cat "$env/build.log"; return 1; }
}
