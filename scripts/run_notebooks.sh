#!/usr/bin/env bash
# Execute every profiling notebook (notebooks/*.ipynb) at its default sizes and write the
# outputs back in place, figures embedded; each notebook also writes its main figure to
# docs/figures/. A few minutes per notebook on 2 cores. Arguments go to
# scripts/run_notebooks.py (e.g. one notebook's path, or -p NAME=VALUE overrides).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" scripts/run_notebooks.py "$@"
