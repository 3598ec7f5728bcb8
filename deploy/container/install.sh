#!/bin/sh
# Install blendmatch into its own virtual environment and compile its JIT code there.
#
# The one install procedure of the container images (Dockerfile, Dockerfile.gpu run it in
# their build stage) and of CI (tests/test_deploy.py runs it into a temporary folder), so
# the steps an image build takes are the steps CI checks. Settings, from the environment:
#
#   BLENDMATCH_SRC        the repository to install (default: two folders above this script)
#   BLENDMATCH_PREFIX     the virtual environment to create (default /opt/blendmatch/venv)
#   BLENDMATCH_CACHE_DIR  where the compiled JIT code goes (default /opt/blendmatch/cache);
#                         the server reads it from the same variable at run time
#   BLENDMATCH_EXTRAS     extras to install (default kafka,kv-events; the GPU image adds
#                         gpu-cuda12)
#   PYTHON                the interpreter the environment is made from (default python3)
#
# It ends with a smoke check: the console script answers --version and the app imports.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
src=${BLENDMATCH_SRC:-$(cd "$here/../.." && pwd)}
prefix=${BLENDMATCH_PREFIX:-/opt/blendmatch/venv}
cache=${BLENDMATCH_CACHE_DIR:-/opt/blendmatch/cache}
extras=${BLENDMATCH_EXTRAS:-kafka,kv-events}
python=${PYTHON:-python3}

echo "install.sh: $src[$extras] into $prefix, JIT cache $cache"
"$python" -m venv "$prefix"
# Not editable: the image must not depend on the build context after this step.
"$prefix/bin/python" -m pip install --disable-pip-version-check "$src[$extras]"
mkdir -p "$cache"
# Compiles every JIT kernel into $cache without serving, so that a server started with the
# same BLENDMATCH_CACHE_DIR (on a CPU of the same model) loads them instead of compiling.
BLENDMATCH_CACHE_DIR="$cache" "$prefix/bin/blendmatch" warmup --cache-dir "$cache"
"$prefix/bin/blendmatch" --version
"$prefix/bin/python" -c "import blendmatch.service.app"
echo "install.sh: done"
