export DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9391 DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=${1:-1}
PY=${MXNET_PYTHON:?set MXNET_PYTHON to the python of a venv with mxnet==1.9.1}
DMLC_ROLE=scheduler $PY -c "import mxnet" & 
for i in $(seq 1 ${1:-1}); do DMLC_ROLE=server $PY -c "import mxnet" & done
DMLC_ROLE=worker $PY "$(dirname "$0")"/dist_worker.py & W1=$!
DMLC_ROLE=worker $PY "$(dirname "$0")"/dist_worker.py & W2=$!
wait $W1 $W2
wait
