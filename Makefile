# fusedce — the front door. Everything real is in CMakeLists.txt.
#   make            build build/libfusedce.so (CUDA backend when nvcc is found)
#   make demo       set up, build, run examples/demo (GPU when there is one, else CPU)
#   make test       set up, build, run every test that needs no GPU (what CI runs)
#   make test-gpu   the same suites on the CUDA backend, under compute-sanitizer, torch parity
#   make bench      the benchmarks (on a GPU machine); writes bench/results/
#   make install PREFIX=/usr/local
BUILD ?= build
PREFIX ?= /usr/local
JOBS ?= $(shell nproc)
CUDA_ARCHS ?= 80;90
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
WITH_CUDA ?= $(if $(NVCC),ON,OFF)
PYTHON ?= python3

.PHONY: all setup setup-demo configure build demo test test-c test-python test-rust test-julia test-examples test-gpu bench install clean

all: build

setup:
	@bash tools/setup.sh test

setup-demo:
	@bash tools/setup.sh demo

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DFCE_WITH_CUDA=$(WITH_CUDA) \
	  "-DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS)" $(if $(NVCC),-DCMAKE_CUDA_COMPILER=$(NVCC)) \
	  -DCMAKE_INSTALL_PREFIX=$(PREFIX)

configure: $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: setup-demo build
	$(BUILD)/examples/demo

test: setup build
	@bash tools/run_tests.sh $(BUILD)

test-gpu: build
	@bash tools/run_gpu_tests.sh $(BUILD)

bench: build
	@bash bench/run.sh $(BUILD)

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD)
