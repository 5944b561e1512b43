# Sourced by the device scripts (gpu_check.sh, speed_check.sh): makes a bare CUDA machine's Python
# see the Jupyter stack and this checkout. Where the Jupyter stack is missing, carry wheels from
# ../shared/device/wheels.sh in .whl/ and they are installed to /tmp/site first.
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# a checkout that is not pip-installed lacks its entry points (the forked ranks' provisioner):
# register them from pyproject.toml, or every start would fall back to fresh interpreters
if ! python3 -c "import importlib.metadata as m, sys; sys.exit(not m.entry_points(group='jupyter_client.kernel_provisioners', name='clorch-forked-rank'))" 2>/dev/null; then
  mkdir -p /tmp/site && python3 scripts/register_entry_points.py /tmp/site \
    && case ":${PYTHONPATH:-}:" in *":/tmp/site:"*) ;; *) PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
fi
# the repository on the path: the Python files under scripts/ import clorch_repl from it
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} ;; esac
export PYTHONUNBUFFERED=1 PYTHONPATH
# step NAME LIMIT CMD...: runs CMD under a time limit, its whole log in $out/NAME.log, its tail shown
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -${TAIL:-25}; }
