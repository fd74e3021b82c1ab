#!/bin/sh
# One Python image's virtual environment, /opt/venv (images/python/Dockerfile's venv stages):
#   venv.sh requirements EXTRA...   tpusync's third-party requirements for those extras
#                                   (pyproject.toml, through images/requirements.py): a layer
#                                   that changes only with pyproject.toml
#   venv.sh wheel MODULE IMPORTS    then the tpusync wheel from /wheels, checked: MODULE's --help
#                                   runs and `import IMPORTS` works in the venv
set -eu
export PIP_DISABLE_PIP_VERSION_CHECK=1
step=$1
shift
case "$step" in
  requirements)
    python -m venv /opt/venv
    python /tmp/requirements.py /tmp/pyproject.toml "$@" > /tmp/requirements.txt
    /opt/venv/bin/pip install -r /tmp/requirements.txt
    ;;
  wheel)
    /opt/venv/bin/pip install --no-deps /wheels/tpusync-*.whl
    /opt/venv/bin/python -m "$1" --help > /dev/null
    /opt/venv/bin/python -c "import $2"
    ;;
  *)
    echo "venv.sh: unknown step $step (requirements or wheel)" >&2
    exit 2
    ;;
esac
